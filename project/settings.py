"""Settings of the example project that installs ``buzz_delivery``.

Everything that differs between machines comes from the environment
(django-environ). ``DATABASE_URL`` picks the database; when it is unset the
project starts an embedded PostgreSQL server (see ``project.embedded``).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(
    DEBUG=(bool, False),
    SECRET_KEY=(str, "insecure-example-key-change-me-in-production-buzz-delivery"),
    ALLOWED_HOSTS=(list, ["localhost", "127.0.0.1"]),
    LOG_LEVEL=(str, "INFO"),
)
environ.Env.read_env(BASE_DIR / ".env")

DEBUG = env("DEBUG")
SECRET_KEY = env("SECRET_KEY")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")

INSTALLED_APPS = [
    "django.contrib.admin",
    # ArrayField (the workflow engine's steps): Django 6 checks that this app is installed.
    "django.contrib.postgres",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "pgtrigger",
    "buzz_delivery",
    "buzz_delivery.workflows",
    "buzz_delivery.agents",
    "buzz_delivery.gateway",
    "buzz_delivery.tasks",
    "project.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files (the admin's CSS and JS) with DEBUG off too, as in production (WhiteNoise).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"

if env.str("DATABASE_URL", default=""):
    DATABASES = {"default": env.db("DATABASE_URL")}
    # A Unix-socket folder may be given percent-encoded in the host part
    # (postgres://postgres@%2Fvar%2Frun%2Fpostgresql/db); libpq wants the plain path.
    DATABASES["default"]["HOST"] = unquote(str(DATABASES["default"].get("HOST") or ""))
else:
    from project.embedded import embedded_database_settings

    DATABASES = {"default": embedded_database_settings()}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
STATIC_URL = "static/"
# ``manage.py collectstatic`` copies the files here for a production server. Until then
# WhiteNoise serves them straight from the apps' static folders (WHITENOISE_USE_FINDERS), so
# ``runserver`` with the default DEBUG=false shows a styled admin without that step.
STATIC_ROOT = BASE_DIR / "var" / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns about a missing STATIC_ROOT
WHITENOISE_USE_FINDERS = env.bool("WHITENOISE_USE_FINDERS", default=True)

# buzz_delivery's settings; every key is optional (see README "Configuration").
BUZZ_DELIVERY: dict[str, object] = {
    "MIN_LEASE_SECONDS": env.float("BUZZ_MIN_LEASE_SECONDS", default=15),
    # Concurrency limits by key, e.g. '{"target": 4}' (docs/flow-control.md).
    "CONCURRENCY_LIMITS": env.json("BUZZ_CONCURRENCY_LIMITS", default={}),
    # ... of agent runs, e.g. '{"agent": 2}', and of workflow steps, e.g. '{"workflow": 10}'.
    "AGENT_CONCURRENCY_LIMITS": env.json("BUZZ_AGENT_CONCURRENCY_LIMITS", default={}),
    "STEP_CONCURRENCY_LIMITS": env.json("BUZZ_STEP_CONCURRENCY_LIMITS", default={}),
    # Rate limits by key, e.g. '{"openai": {"limit": 500, "period": 60}}' (docs/flow-control.md).
    "RATE_LIMITS": env.json("BUZZ_RATE_LIMITS", default={}),
    "RETRY_BACKOFF_BASE_SECONDS": env.float("BUZZ_RETRY_BACKOFF_BASE_SECONDS", default=5),
    # Row-level security (docs/tenant-isolation.md): the services run each call as the tenant or
    # the maintenance role, so the policies hold even for this superuser login.
    "SWITCH_ROLES": env.bool("BUZZ_SWITCH_ROLES", default=True),
}
# The agent gateway (buzz_delivery.gateway, mounted at /gateway/v1/); every key is optional.
BUZZ_GATEWAY: dict[str, object] = {
    "AUTH_WINDOW_SECONDS": env.float("BUZZ_GATEWAY_AUTH_WINDOW_SECONDS", default=60),
    "MAX_BODY_BYTES": env.int("BUZZ_GATEWAY_MAX_BODY_BYTES", default=64 * 1024),
    "MAX_WAIT_SECONDS": env.float("BUZZ_GATEWAY_MAX_WAIT_SECONDS", default=30),
    "POLL_SECONDS": env.float("BUZZ_GATEWAY_POLL_SECONDS", default=1.0),
    "PUBLIC_BASE_URL": env.str("BUZZ_GATEWAY_PUBLIC_BASE_URL", default="") or None,
    "MAX_REQUESTS_PER_KEY": env.int("BUZZ_GATEWAY_MAX_REQUESTS_PER_KEY", default=16),
    "MAX_REQUESTS_PER_COMMUNITY": env.int("BUZZ_GATEWAY_MAX_REQUESTS_PER_COMMUNITY", default=24),
    "MAX_LONG_POLLS_PER_KEY": env.int("BUZZ_GATEWAY_MAX_LONG_POLLS_PER_KEY", default=4),
    "MAX_LONG_POLLS_PER_COMMUNITY": env.int("BUZZ_GATEWAY_MAX_LONG_POLLS_PER_COMMUNITY", default=12),
}
# Workers connected through a transaction pooler hear no NOTIFY: give their LISTEN a direct URL.
if env.str("BUZZ_LISTEN_DATABASE_URL", default=""):
    DATABASES["listen"] = env.db("BUZZ_LISTEN_DATABASE_URL")
    BUZZ_DELIVERY["LISTEN_DATABASE"] = "listen"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "buzz_delivery": {"handlers": ["console"], "level": env("LOG_LEVEL"), "propagate": False},
    },
}

# django.tasks through the delivery inbox (buzz_delivery.tasks, docs/tasks.md). The community is
# the tenant the tasks belong to; BUZZ_TASKS_COMMUNITY names one (the example's default is fixed).
TASKS = {
    "default": {
        "BACKEND": "buzz_delivery.tasks.DeliveryBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"COMMUNITY": env.str("BUZZ_TASKS_COMMUNITY", default="01900000-0000-7000-8000-00000000da5c")},
    }
}
