"""``gateway_key new --out PATH`` makes an agent's key pair: the secret goes to PATH (mode 0600,
refused if PATH exists unless ``--force``), the public key to enroll is printed with the two
commands that follow. ``gateway_key show PATH`` prints the public key of a secret file.
Exit 2 on bad arguments, 1 when the file cannot be written or read."""

from __future__ import annotations

import shlex
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from buzz_delivery.gateway import keys


class Command(BaseCommand):
    help = "Make an agent key pair for the gateway (new --out PATH), or print a secret file's public key (show PATH)."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, parser_class=CommandParser)
        new = sub.add_parser("new", help="make a key pair; write the secret to --out, print the public key")
        new.add_argument("--out", required=True, help="file for the secret key (64 hex characters, mode 0600)")
        new.add_argument("--force", action="store_true", help="replace --out if it exists (default: refuse)")
        new.add_argument("--community", default="COMMUNITY_ID", help="community UUID for the printed enroll command")
        new.add_argument("--url", default="URL", help="gateway base URL for the printed work command")
        show = sub.add_parser("show", help="print the public key (64 hex characters) of a secret key file")
        show.add_argument("path", help="the secret key file")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "show":
            try:
                self.stdout.write(keys.public_key_hex(options["path"]))
            except (OSError, ValueError) as exc:
                raise CommandError(f"{options['path']}: {exc}", returncode=1) from exc
            return
        secret = keys.new_secret()
        try:
            path = keys.write_secret(options["out"], secret, overwrite=options["force"])
        except keys.KeyFileExists as exc:
            raise CommandError(str(exc), returncode=1) from exc
        except OSError as exc:
            raise CommandError(f"{options['out']}: {exc}", returncode=1) from exc
        public = keys.public_key_hex(path)
        quoted = shlex.quote(str(path))
        self.stdout.write(public)
        if options["verbosity"] >= 1:
            self.stderr.write(
                f"Secret key written to {path} (mode 0600): keep it with the agent, never share it.\n"
                f"Enroll the public key above:\n"
                f"  python manage.py gateway_enrollment enroll --community {options['community']} --agent {public}\n"
                f"Then work through the gateway, either its deliveries (handle(delivery)):\n"
                f"  python -m buzz_delivery.gateway.client work --url {options['url']} --key-file {quoted}"
                " --handler pkg.module:handler\n"
                f"or its agent runs (handle(ctx), the deliveries accepted into runs; not both for one key):\n"
                f"  python -m buzz_delivery.gateway.client work-runs --url {options['url']} --key-file {quoted}"
                " --handler pkg.module:handler",
                style_func=lambda text: text,
            )
