"""docs/django.md starts from a project that runs as printed: its settings,
views, URLs and AppConfig become a project in a temporary folder, and a
fresh Python process migrates it and drives it with Django's test client."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.helpers import ROOT

PAGE = ROOT / "docs" / "django.md"

# What any settings module has and the page leaves out.
BASE_SETTINGS = """
SECRET_KEY = "docs-example"
ALLOWED_HOSTS = ["testserver"]
ROOT_URLCONF = "urls"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True
"""

DRIVE = """
import json
import django
django.setup()
from django.core.management import call_command
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.authtoken.models import Token
from idemctl import Ledger

call_command("migrate", verbosity=0)  # the AppConfig's post_migrate creates the ledger
alice = User.objects.create_user("alice", password="pw")
api = {"HTTP_AUTHORIZATION": "Token " + Token.objects.create(user=alice).key}

def order(client, path, body, key, **extra):
    if key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = key
    reply = client.post(path, body, content_type="application/json", **extra)
    return [reply.status_code, reply.get("Location"), reply.content.decode()]

browser = Client()
browser.force_login(alice)
form = lambda key: browser.post("/orders/form", {"sku": "jam"}, HTTP_IDEMPOTENCY_KEY=key)
results = {
    "first": order(Client(), "/orders", '{"sku":"tea"}', "order-42", **api),
    "again": order(Client(), "/orders", '{"sku":"tea"}', "order-42", **api),
    "other body": order(Client(), "/orders", '{"sku":"jam"}', "order-42", **api),
    "no key": order(Client(), "/orders", '{"sku":"tea"}', None, **api),
    "form": [form("form-1").status_code, form("form-1").content.decode()],
    "anonymous form": Client().post("/orders/form", {"sku": "jam"}, HTTP_IDEMPOTENCY_KEY="form-2").status_code,
    "sign in without a key": Client().post("/sign-in").status_code,
}
with Ledger.open("idempotency.db", create=False) as ledger:
    results["rows"] = sorted(view.row.key for view in [ledger.operator.get(str(alice.pk), k) for k in ("order-42", "form-1")])
print(json.dumps(results))
"""


def python_blocks() -> dict[str, str]:
    """The page's Python blocks, by the file their first line names."""
    blocks = re.findall(r"```python\n# (\S+)[^\n]*\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    return {name: body for name, body in blocks}


def test_the_django_pages_first_example_places_each_order_once_per_key(tmp_path):
    blocks = python_blocks()
    assert {"settings.py", "orders/views.py", "urls.py", "orders/apps.py"} <= set(blocks), sorted(blocks)
    (tmp_path / "docs_settings.py").write_text(BASE_SETTINGS + blocks["settings.py"])
    (tmp_path / "urls.py").write_text(blocks["urls.py"])
    (tmp_path / "orders").mkdir()
    (tmp_path / "orders" / "__init__.py").write_text("")
    (tmp_path / "orders" / "models.py").write_text("")  # an app with models: Django sends it post_migrate
    (tmp_path / "orders" / "views.py").write_text(blocks["orders/views.py"])
    (tmp_path / "orders" / "apps.py").write_text(blocks["orders/apps.py"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMCTL_", "DJANGO_"))}
    env.update(DJANGO_SETTINGS_MODULE="docs_settings", PYTHONPATH=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", DRIVE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    created = [201, "/orders/42", '{"id":42,"account":"alice","sku":"tea"}']
    assert results == {
        "first": created,
        "again": created,
        "other body": [409, None, '{"error":"idempotency_key_reused"}'],
        "no key": [400, None, '{"error":"idempotency_key_required"}'],
        "form": [201, '{"id": 42, "account": "alice", "sku": "jam"}'],
        "anonymous form": 401,
        "sign in without a key": 200,
        "rows": ["form-1", "order-42"],
    }
