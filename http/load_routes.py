"""SGLang's `GET /get_load`: what a router's load-aware policies poll (sglang-router's load
monitor for power_of_two and cache_aware's balance; vllm-router reads it too).

One entry per data-parallel replica, as SGLang answers one per DP rank: `num_reqs` requests
held (running and waiting), `num_waiting_reqs` of them not yet admitted, `num_tokens` KV
positions in use (blocks held x block size: saved prefixes count, as in `/metrics`).
"""

from __future__ import annotations

from aiohttp import web

from deltaserve.engine.events import LoadSnapshot
from deltaserve.http.server import STATE, _json


def add_routes(app: web.Application) -> None:
    app.router.add_get("/get_load", get_load)


async def get_load(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    replicas = getattr(engine, "replicas", [engine])  # a DataParallelEngine's, or the one
    block_size = engine.config.block_size
    return _json([_entry(rank, r.load(), block_size) for rank, r in enumerate(replicas)])


def _entry(rank: int, load: LoadSnapshot, block_size: int) -> dict[str, int]:
    return {
        "dp_rank": rank,
        "num_reqs": load.running + load.waiting,
        "num_waiting_reqs": load.waiting,
        "num_tokens": (load.num_blocks - load.free_blocks) * block_size,
    }
