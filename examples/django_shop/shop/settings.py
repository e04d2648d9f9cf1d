"""The shop's settings: PostgreSQL from SHOP_DATABASE_URL, duebox's app in DUEBOX_APP."""

import os
from urllib.parse import unquote, urlsplit

_db = urlsplit(os.environ.get("SHOP_DATABASE_URL", "postgresql://localhost/shop"))

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "only-for-the-example")
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
INSTALLED_APPS = ["duebox_django", "orders"]
ROOT_URLCONF = "shop.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # on psycopg 3
        "NAME": _db.path.lstrip("/"),
        "USER": unquote(_db.username or ""),
        "PASSWORD": unquote(_db.password or ""),
        "HOST": _db.hostname or "",
        "PORT": str(_db.port or ""),
    }
}

# `manage.py duebox relay|worker|db upgrade|status ...` loads this app.
DUEBOX_APP = "orders.jobs:jobs"
DUEBOX_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "sql://")
