"""Time to receive a query reply whole, from one message to many parts.

A query endpoint (:func:`services.runtime.bus.queries.answering`, as the audit and
billing subscribers serve theirs) answers with a reply of a given size; the CLI's
:class:`~services.runtime.bus.apiclient.ApiClient` asks for it and joins the parts
(:mod:`services.runtime.bus.replies`). The sizes go from one message (0.5 MB) to the
length of a full ``dracap audit`` (10,000 records are about 4.5 MB) and beyond, on the
broker's default ``max_payload`` of 1 MiB. What is measured is the request until the
whole reply is decoded: serving, splitting, the bus, joining and JSON.

Usage::

    .venv/bin/python -m benchmarks.replies [--nats URL] [--repeat 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from benchmarks.pipeline import add_server_arguments
from events.subjects import BusNames
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.jetstream import connect_bus
from services.runtime.bus.replies import HEADROOM
from tests.fixtures.blobs import blob_endpoint

SIZES = (500_000, 4_500_000, 20_000_000, 60_000_000)


async def main(args: argparse.Namespace) -> None:
    names = BusNames(prefix=f"bench{uuid.uuid4().hex[:8]}")
    nc, _ = await connect_bus(args.nats)
    try:
        async with (
            blob_endpoint(nc, names),
            ApiClient.connect(args.nats, names.prefix) as api,
        ):
            api.timeout = 60
            max_payload = api.nc.max_payload
            print(f"broker max_payload {max_payload:,} bytes; {args.repeat} requests per size")
            for size in SIZES:
                took = []
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    reply = await api.admin("blob.list", {"size": size})
                    took.append(time.perf_counter() - started)
                    assert len(reply["blob"]) == size
                parts = -(-size // (max_payload - HEADROOM))
                print(
                    f"  {size / 1e6:5.1f} MB ({parts:2d} part(s)): median "
                    f"{statistics.median(took) * 1e3:7.1f} ms, max {max(took) * 1e3:7.1f} ms"
                )
    finally:
        await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(parser)
    parser.add_argument("--repeat", type=int, default=7)
    asyncio.run(main(parser.parse_args()))
