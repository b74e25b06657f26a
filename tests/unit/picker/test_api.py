"""``picker.api``, the public entry points: it exports every name the benchmarks and examples import (they may
import nothing else, by the import-linter contract), and an embedder can build, route, encode and score with
those names alone."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import picker.api as api
from picker.api import (
    DEST_HEADER,
    Endpoint,
    EndpointState,
    Exchange,
    Inbound,
    InMemoryKvIndex,
    KvOverlapScorer,
    PickerApp,
    PoolView,
    RequestPath,
    Settings,
    build_app,
    load_settings,
    parse_settings,
    pick_response,
)
from picker.shared.tiers import StorageTier

REPO = Path(__file__).resolve().parents[3]


def imported_from_api(root: Path) -> dict[str, set[str]]:
    """name -> files that import it from ``picker.api`` (``from picker.api import ...``)."""
    out: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "picker.api":
                for alias in node.names:
                    out.setdefault(alias.name, set()).add(str(path.relative_to(REPO)))
    return out


def test_all_names_exactly_the_public_entry_points_and_each_is_defined() -> None:
    assert len(set(api.__all__)) == len(api.__all__)
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert missing == []
    public = {n for n in vars(api) if not n.startswith("_") and n != "annotations"}
    assert public == set(api.__all__)  # nothing importable by accident, nothing listed but absent


def test_every_name_the_benchmarks_and_examples_import_is_exported() -> None:
    used: dict[str, set[str]] = {}
    for root in (REPO / "benchmarks", REPO / "examples"):
        if root.is_dir():
            for name, files in imported_from_api(root).items():
                used.setdefault(name, set()).update(files)
    assert used, "the benchmarks import their picker names from picker.api"
    assert {n: f for n, f in used.items() if n not in api.__all__} == {}


async def test_an_embedder_routes_and_encodes_a_pick_with_public_names_only() -> None:
    app = build_app(
        parse_settings({"pool": {"backends": [{"name": "a", "address": "10.0.0.1:8000"}]}, "prefix_routing": {}})
    )
    assert isinstance(app, PickerApp) and isinstance(app.path, RequestPath)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    ex = await app.path.route(Inbound("/v1/chat/completions", {":method": "POST"}, body))
    assert isinstance(ex, Exchange) and ex.decision.endpoint == Endpoint("a", "10.0.0.1:8000")
    r = pick_response(ex.decision.destinations(), None, on_body=False)
    header = r.request_headers.response.header_mutation.set_headers[0].header
    assert (header.key, header.raw_value) == (DEST_HEADER, b"10.0.0.1:8000")
    ex.end(completed=True)
    assert app.pool.in_flight() == {"a": 0}


def test_load_settings_reads_a_yaml_file_and_defaults_without_one(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text("selection_strategy: RoundRobin\npool:\n  backends:\n    - {name: a, address: '10.0.0.1:80'}\n")
    s = load_settings(path)
    assert isinstance(s, Settings) and s.selection_strategy == "RoundRobin" and s.pool.backends[0].name == "a"
    assert load_settings(None) == parse_settings({})


def test_the_tier4_pieces_compose_through_the_public_surface() -> None:
    """What benchmarks/kv_index_scale.py does: fill an index, look a prefix up, score the holds over a view."""
    index = InMemoryKvIndex(max_entries=100, ttl_seconds=3600)
    index.put("a", [1, 2, 3, 4], StorageTier.GPU_HOT, now=0.0)
    index.put("b", [1, 2], StorageTier.GPU_HOT, now=0.0)
    holds = index.lookup([1, 2, 3, 4], now=1.0)
    assert {name: h.blocks for name, h in holds.items()} == {"a": 4, "b": 2}
    scorer = KvOverlapScorer(Settings().kv_cache_index.scoring, 16)
    view = PoolView(tuple(EndpointState(Endpoint(n, f"10.0.0.{i}:80")) for i, n in enumerate("abc")))
    result = scorer.score(holds, view)
    assert result.best is not None and result.best.name == "a"
    assert result.scores["a"] > result.scores["b"] > result.scores["c"] == 0.0
