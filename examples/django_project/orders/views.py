"""The orders API (DRF, token authentication) and its browser counterpart (a
plain Django view, session authentication).

    GET    /orders            the caller's orders
    POST   /orders            {"sku": "...", "qty": 1} -> 201 + Location
    GET    /orders/<id>       one order
    DELETE /orders/<id>       cancel -> 204
    GET    /session           {"csrf": token}, and the CSRF cookie
    POST   /session           {"username": ..., "password": ...} -> {"csrf": token}, and the session cookie
    POST   /session/orders    {"sku": "...", "qty": 1} -> 201 + Location (session cookie and X-CSRFToken)

DRF authenticates inside its views, so the DRF views add IdempotencyMixin:
their principal is the user the token belongs to. The plain view is
protected by the middleware, whose principal is the session's user.
"""

import json
import os

from django.contrib.auth import authenticate, login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import get_token
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_http_methods, require_POST
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from idemctl.django import IdempotencyMixin, idempotency_exempt

from .models import Order


class OrderSerializer(serializers.ModelSerializer):
    account = serializers.CharField(source="account.username", read_only=True)
    qty = serializers.IntegerField(min_value=1, default=1)

    class Meta:
        model = Order
        fields = ("id", "account", "sku", "qty", "status")
        read_only_fields = ("id", "status")


class OrderList(IdempotencyMixin, APIView):
    def get(self, request: Request) -> Response:
        orders = Order.objects.filter(account=request.user).order_by("id")
        return Response({"orders": OrderSerializer(orders, many=True).data})

    def post(self, request: Request) -> Response:
        order = OrderSerializer(data=request.data)
        order.is_valid(raise_exception=True)
        created = order.save(account=request.user)
        return Response(order.data, status=201, headers={"Location": f"/orders/{created.pk}"})


class OrderDetail(IdempotencyMixin, APIView):
    def get(self, request: Request, pk: int) -> Response:
        return Response(OrderSerializer(get_object_or_404(Order, pk=pk, account=request.user)).data)

    def delete(self, request: Request, pk: int) -> Response:
        order = get_object_or_404(Order, pk=pk, account=request.user)
        order.status = "cancelled"
        order.save(update_fields=["status"])
        return Response(status=204)


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True, "pid": os.getpid()})


@idempotency_exempt  # signing in twice is harmless: no Idempotency-Key needed
@require_http_methods(["GET", "POST"])
def session(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        credentials = json.loads(request.body or b"{}")
        user = authenticate(request, username=credentials.get("username"), password=credentials.get("password"))
        if user is None:
            return JsonResponse({"error": "invalid_credentials"}, status=401)
        login(request, user)
    return JsonResponse({"csrf": get_token(request)})


@require_POST
def create_order_in_session(request: HttpRequest) -> HttpResponse:
    # The middleware answered 401 already unless a user is signed in.
    order = OrderSerializer(data=json.loads(request.body or b"{}"))
    if not order.is_valid():
        return JsonResponse(order.errors, status=400)
    created = order.save(account=request.user)
    response = JsonResponse(order.data, status=201)
    response["Location"] = f"/orders/{created.pk}"
    return response
