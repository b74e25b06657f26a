"""Where Tier 4's token ids come from: the engine's ``/tokenize`` or a local tokenizer (in worker threads).
See docs/picker.md, "Tokenizer sources".
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import aiohttp
import orjson

from picker.config import TokenizerConfig

log = logging.getLogger("kv_epp.tokenizer")

Messages = Sequence[dict[str, Any]]
MAX_TOKENIZE_RESPONSE_BYTES = 8 << 20  # a larger /tokenize answer is treated as a failure
_JSON = {"Content-Type": "application/json"}


class TokenizerSource(Protocol):
    """``token_ids`` returns the prompt's token ids as the engine would see them, or None. Chat messages are
    rendered with the generation prompt unless ``add_generation_prompt`` is False (the tokenization cache's
    fills: a conversation's history as the next turn's prompt begins with it)."""

    async def token_ids(
        self,
        model: str,
        messages: Messages | None = None,
        prompt: str | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int] | None: ...

    async def close(self) -> None: ...


class NoTokenizer:
    """Tier 4 disabled: no token ids, ever."""

    async def token_ids(
        self,
        model: str,
        messages: Messages | None = None,
        prompt: str | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int] | None:
        return None

    async def close(self) -> None:
        return None


def _valid_tokens(v: object) -> list[int] | None:
    if not isinstance(v, list):
        return None
    for t in v:
        if type(t) is not int or t < 0 or t > 0xFFFFFFFF:
            return None
    return v


async def _read_bounded(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body, or None past ``limit`` bytes. ``StreamReader.read(n)`` returns only what has arrived
    so far: an answer written in two pieces (any long prompt on a real network) was read half, failed to
    parse, and Tier 4 fell back."""
    parts: list[bytes] = []
    size = 0
    async for chunk in content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


class EngineTokenizer:
    """POST ``{base_url}/tokenize`` on an engine chosen by ``base_url_for(model)``."""

    def __init__(
        self,
        base_url_for: Callable[[str], str | None],
        timeout_ms: int = 50,
        max_concurrency: int = 64,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url_for = base_url_for
        self.timeout_s = timeout_ms / 1000
        # in-flight /tokenize calls; bound max_concurrency, a request that cannot get a slot in time gets None
        self._slots = asyncio.Semaphore(max_concurrency)
        self._session = session
        self._own_session = session is None
        self.failures: dict[str, int] = {}

    def _fail(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                timeout=aiohttp.ClientTimeout(total=None),
            )
            self._own_session = True
        return self._session

    async def token_ids(
        self,
        model: str,
        messages: Messages | None = None,
        prompt: str | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int] | None:
        base = self.base_url_for(model)
        if base is None or (messages is None and prompt is None):
            self._fail("no_input")
            return None
        body: dict[str, Any] = {"model": model}
        if messages is not None:
            body["messages"] = list(messages)
            body["add_generation_prompt"] = add_generation_prompt
        else:
            body["prompt"] = prompt
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._slots:
                    session = self._get_session()
                    url = base.rstrip("/") + "/tokenize"
                    async with session.post(url, data=orjson.dumps(body), headers=_JSON) as resp:
                        if resp.status != 200:
                            self._fail("http_status")
                            return None
                        raw = await _read_bounded(resp.content, MAX_TOKENIZE_RESPONSE_BYTES)
            if raw is None:
                self._fail("too_large")
                return None
            data = orjson.loads(raw)
            tokens = _valid_tokens(data.get("tokens") if isinstance(data, dict) else None)
            if tokens is None:
                self._fail("bad_response")
            return tokens
        except TimeoutError:
            self._fail("timeout")
        except (aiohttp.ClientError, OSError, ValueError):
            self._fail("error")
        except Exception:  # never fail a request because of the tokenizer
            log.exception("event=tokenize_failed model=%r", model)  # the client's model name: escaped
            self._fail("error")
        return None

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None


def local_tokenizer_available() -> bool:
    """True when the optional ``tokenizers`` and ``jinja2`` packages are installed."""
    try:
        importlib.import_module("tokenizers")
        importlib.import_module("jinja2")
    except ImportError:
        return False
    return True


class LocalTokenizer:
    """A HuggingFace ``tokenizer.json`` plus a Jinja chat template, loaded lazily in a worker thread.

    Bound: at most ``max_concurrency`` encodes run at once, each in a thread of this source's own pool; a
    slot is released when its thread finishes, not when the caller stops waiting (a thread cannot be
    cancelled), so encodes that outlive their callers' timeouts never pile up past the bound."""

    def __init__(
        self,
        tokenizer_path: str,
        chat_template_path: str | None = None,
        timeout_ms: int = 50,
        max_concurrency: int = 4,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.chat_template_path = chat_template_path
        self.timeout_s = timeout_ms / 1000
        self.special_tokens = special_tokens or {}
        self._slots = asyncio.Semaphore(max_concurrency)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="kv-local-tokenizer")
        self._tok: Any = None
        self._template: Any = None
        self._load_failed = False
        self._load_lock = asyncio.Lock()

    def _load(self) -> None:
        tokenizers = importlib.import_module("tokenizers")
        self._tok = tokenizers.Tokenizer.from_file(self.tokenizer_path)
        if self.chat_template_path:
            jinja2 = importlib.import_module("jinja2")
            with open(self.chat_template_path, encoding="utf-8") as f:
                source = f.read()
            env = jinja2.Environment(autoescape=False, trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error  # HF templates call it on bad input
            self._template = env.from_string(source)

    async def _ensure_loaded(self) -> bool:
        if self._tok is not None:
            return True
        if self._load_failed:
            return False
        async with self._load_lock:
            if self._tok is None and not self._load_failed:
                try:
                    await asyncio.get_running_loop().run_in_executor(self._pool, self._load)
                except Exception as exc:  # missing extra, bad file: Tier 4 off, logged once
                    self._load_failed = True
                    log.warning("event=local_tokenizer_unavailable path=%s error=%s", self.tokenizer_path, exc)
        return self._tok is not None

    def _encode(self, messages: Messages | None, prompt: str | None, add_generation_prompt: bool) -> list[int]:
        if messages is not None:
            if self._template is None:
                raise ValueError("chat messages need a chat template")
            text = self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
            add_special = False
        else:
            text, add_special = prompt or "", True
        return list(self._tok.encode(text, add_special_tokens=add_special).ids)

    async def token_ids(
        self,
        model: str,
        messages: Messages | None = None,
        prompt: str | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int] | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                if not await self._ensure_loaded():
                    return None
                await self._slots.acquire()
                try:
                    work = asyncio.get_running_loop().run_in_executor(
                        self._pool, self._encode, messages, prompt, add_generation_prompt
                    )
                except BaseException:
                    self._slots.release()
                    raise
                work.add_done_callback(lambda _: self._slots.release())  # when the thread is done
                return await asyncio.shield(work)
        except Exception:
            return None

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def make_tokenizer_source(
    cfg: TokenizerConfig, base_url_for: Callable[[str], str | None] | None = None
) -> TokenizerSource:
    """The configured source, chosen by name (``engine``, ``local``, ``none``)."""
    if cfg.source == "engine":
        if base_url_for is None:
            raise ValueError("tokenizer source 'engine' needs base_url_for(model) -> base URL")
        return EngineTokenizer(base_url_for, cfg.timeout_cap_ms, cfg.max_concurrency)
    if cfg.source == "local":
        if not cfg.local_path or not local_tokenizer_available():
            log.warning("event=local_tokenizer_unavailable action=tier4_off path=%s", cfg.local_path)
            return NoTokenizer()
        return LocalTokenizer(cfg.local_path, cfg.chat_template_path, cfg.timeout_cap_ms, min(cfg.max_concurrency, 8))
    return NoTokenizer()
