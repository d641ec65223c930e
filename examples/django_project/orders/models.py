from django.conf import settings
from django.db import models


class Order(models.Model):
    account = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="orders")
    sku = models.CharField(max_length=100)
    qty = models.PositiveIntegerField(default=1)
    status = models.CharField(max_length=20, default="open")
    created_at = models.DateTimeField(auto_now_add=True)
