"""The ASGI application: `uvicorn orders_site.asgi:application` from examples/django_project."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orders_site.settings")
application = get_asgi_application()
