from django.urls import path
from orders import views

urlpatterns = [
    path("healthz", views.healthz),
    # The API: DRF, token authentication.
    path("orders", views.OrderList.as_view()),
    path("orders/<int:pk>", views.OrderDetail.as_view()),
    # Browsers: a plain Django view, session authentication.
    path("session", views.session),
    path("session/orders", views.create_order_in_session),
]
