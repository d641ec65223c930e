"""The WSGI application: `gunicorn -w 4 orders_site.wsgi` from examples/django_project."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orders_site.settings")
application = get_wsgi_application()
