"""`gatewayctl keys create | list | revoke`: edits the key file directly (the gateway, running
or not, picks the change up on its next request)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

import msgspec

from gateway.edge.keys import ApiKey, KeyError_, KeyStore, keys_path, parse_expiry
from shared.addresses import is_loopback
from shared.config import Config, ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="API keys: create, list, revoke")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (once)")
    create.add_argument("name")
    create.add_argument("--scope", choices=["inference", "admin"], default="inference")
    create.add_argument("--models", help="comma-separated models the key may use (default all)")
    create.add_argument("--rpm", type=int, help="requests per minute")
    create.add_argument("--tpm", type=int, help="prompt + completion tokens per minute")
    create.add_argument("--concurrency", type=int, help="requests in flight at once")
    create.add_argument("--priority", choices=["interactive", "batch"], default="interactive")
    create.add_argument("--expires", help="a duration (30d, 12h) or a date (2027-01-31)")
    create.add_argument("--json", action="store_true")
    listing = keys_sub.add_parser("list", help="keys without their secrets")
    listing.add_argument("--all", action="store_true", help="also revoked keys")
    listing.add_argument("--json", action="store_true")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by name or id (at once)")
    revoke.add_argument("key")


def run(args: argparse.Namespace, config: Config) -> int:
    store = KeyStore(keys_path(config.server.keys_file))
    try:
        if args.keys_command == "create":
            models = [m.strip() for m in (args.models or "").split(",") if m.strip()]
            expires = parse_expiry(args.expires) if args.expires else None
            secret, record = store.create(
                args.name,
                scope=args.scope,
                models=models,
                rpm=args.rpm,
                tpm=args.tpm,
                concurrency=args.concurrency,
                priority=args.priority,
                expires_at=expires,
            )
            if args.json:
                print(json.dumps({"key": secret, **_row(record)}))
            else:
                print(secret)
                print(
                    f"key {record.name!r} ({record.scope}) created in {store.path}; "
                    "this is the only time it is shown",
                    file=sys.stderr,
                )
            return 0
        if args.keys_command == "list":
            rows = [_row(k) for k in store.all() if args.all or k.revoked_at is None]
            if args.json:
                print(json.dumps(rows))
            else:
                _print_table(rows)
            return 0
        if args.keys_command == "revoke":
            record = store.revoke(args.key)
            print(f"revoked key {record.name!r} ({record.display})")
            return 0
    except (KeyError_, ConfigError) as exc:
        print(f"gatewayctl keys: {exc}", file=sys.stderr)
        return 2
    return 2


def _when(ts: float | None) -> str | None:
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def _row(key: ApiKey) -> dict[str, object]:
    row: dict[str, object] = msgspec.structs.asdict(key)
    row.pop("hash", None)
    row["key"] = key.display
    row["status"] = (
        "revoked" if key.revoked_at is not None else "active" if key.active() else "expired"
    )
    for field in ("created_at", "expires_at", "revoked_at"):
        row[field] = _when(getattr(key, field))
    return row


def _print_table(rows: list[dict[str, object]]) -> None:
    if not rows:
        print("no keys (create one with `gatewayctl keys create NAME`)")
        return
    cols = ["name", "key", "scope", "status", "models", "rpm", "tpm", "concurrency", "priority"]
    cols.append("expires_at")
    table = [
        [
            ",".join(str(m) for m in v) or "*"
            if isinstance(v := r.get(c), list)
            else "-"
            if v is None
            else str(v)
            for c in cols
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def check_bind(config: Config) -> str | None:
    """Why serving this config is refused (a non-loopback address with no key), or None."""
    server = config.server
    if is_loopback(server.host) or server.insecure_no_auth:
        return None
    store = KeyStore(keys_path(server.keys_file))
    try:
        if store.active_count() > 0:
            return None
    except ConfigError as exc:
        return f"refusing to serve {server.host}:{server.port}: {exc}"
    return (
        f"refusing to serve {server.host}:{server.port} without API keys: anyone on the "
        f"network could use it. Create a key first (`gatewayctl keys create NAME`, stored in "
        f"{store.path}), bind 127.0.0.1, or pass --insecure-no-auth "
        "(server.insecure_no_auth = true) to serve it open on purpose."
    )
