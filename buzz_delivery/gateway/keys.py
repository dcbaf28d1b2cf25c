"""An agent's key pair for the gateway (SPEC section 14): made, written and read back.

The secret is 32 random bytes (``coincurve``, the library that signs the gateway's NIP-98
events), stored as 64 hex characters and a newline in a file only its owner may read or write
(mode 0600, set when the file is created, never after). The public key to enroll is its 32-byte
x-only key, the deliveries' ``target_pubkey``. ``manage.py gateway_key`` is the operator's way in.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import coincurve

from buzz_delivery.gateway.client import read_key_file
from buzz_delivery.gateway.nip98 import public_key_of

SECRET_FILE_MODE = 0o600


class KeyFileExists(FileExistsError):
    """The secret file exists already; pass ``overwrite=True`` to replace it."""


def new_secret() -> bytes:
    """A fresh, valid secp256k1 secret key (32 bytes from the OS's random source)."""
    return coincurve.PrivateKey().secret


def write_secret(path: str | os.PathLike[str], secret: bytes, *, overwrite: bool = False) -> Path:
    """Write ``secret`` as hex to ``path`` with mode 0600 from the first byte on. Refuses an
    existing file (:class:`KeyFileExists`) unless ``overwrite``; then the new file is written
    beside it and renamed over it, so a reader sees the old key or the new one, never half."""
    target = Path(path)
    text = (secret.hex() + "\n").encode("ascii")
    if not overwrite:
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SECRET_FILE_MODE)
        except FileExistsError:
            raise KeyFileExists(f"{target} exists; pass --force to replace it") from None
        with os.fdopen(fd, "wb") as out:
            out.write(text)
        return target
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(text)
        os.chmod(temporary, SECRET_FILE_MODE)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def public_key_hex(path: str | os.PathLike[str]) -> str:
    """The public key (64 hex characters) of the secret in ``path``; ``ValueError`` for a file
    that does not hold one."""
    return public_key_of(read_key_file(str(path))).hex()
