from django.apps import AppConfig
from django.db.models.signals import post_migrate

from idemctl.django import init_ledger


class OrdersConfig(AppConfig):
    name = "orders"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # `manage.py migrate` creates (or upgrades) the idempotency ledger too.
        post_migrate.connect(init_ledger, sender=self)
