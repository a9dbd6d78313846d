"""vLLM's realtime transcription WebSocket (``/v1/realtime``) on the simulator's engine.

Rebuilt from ``vllm/entrypoints/speech_to_text/realtime/`` (``connection.py`` at commit
8ba6842cb27670ef5363c9453a9a4f8f58b87aaf, ``protocol.py`` at
c6088cb14ab5c540283078e14de4eed944164604, ``api_router.py`` at
dd58f7d12aed6c96c6e43fcec2c508e18bc8496b; earlier under ``vllm/entrypoints/openai/realtime/``,
same protocol). Shapes: ``tests/fixtures/vllm_realtime_session.jsonl``.

The exchange, as vLLM runs it: the server accepts and sends ``session.created``; the client's
``session.update`` names the model; a plain ``input_audio_buffer.commit`` starts the
transcription, ``input_audio_buffer.append`` events carry base64 PCM16 (16 kHz mono), and a
commit with ``final: true`` ends the audio; the server answers ``transcription.delta`` events
then ``transcription.done`` with the whole text and usage, and waits for the next utterance.
Every mistake is an ``error`` event (``{"type", "error", "code"}``) on an open socket; the
server never closes it (a binary frame ends vLLM's handler, so it ends this one too).

The simulator transcribes once the audio is complete (vLLM streams while it arrives): one
engine request, so batching, metrics and the ``stall``/``slow``/``engine_dead`` faults act on
it. As Voxtral Realtime does, it emits one token per 80 ms frame, most of them padding that
decodes to an empty delta; the words are the deterministic output of ``generate.py``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
import uuid
import zlib
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from . import formats, tokenizer
from .engine import EngineDead
from .generate import Output
from .replica import Sim
from .scheduler import EngineRequest

log = logging.getLogger("tokenlane.sim")

PATH = "/v1/realtime"
FRAME_BYTES = 2 * 1280  # one output token per 80 ms of 16 kHz PCM16 (Voxtral's 12.5 Hz)
DELAY_FRAMES = 6  # made up: the right padding that flushes the transcription delay
TEXT_EVERY = 4  # one frame in 4 carries a word piece (~3 tokens/s, speech pace)
PREFIX = [tokenizer.MEDIA_PLACEHOLDER_ID] * 39  # made up: BOS and streaming pad tokens
MAX_CHUNK_MB = 25  # VLLM_MAX_AUDIO_CLIP_FILESIZE_MB, compared with samples as vLLM does
NOT_VALIDATED = (
    "Model not validated. Make sure to validate the model by sending a session.update event."
)
BOOL_STRINGS = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
                "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}  # fmt: skip


def _dump(event: dict[str, Any]) -> str:
    """pydantic's ``model_dump_json``: compact, non-ASCII as is."""
    return formats.compact(event).decode()


def _pydantic_error(model: str, field: str, kind: str, msg: str, value: Any) -> str:
    """pydantic's text for one invalid field (vLLM sends it as ``processing_error``)."""
    shown = repr(value)
    if len(shown) > 50:
        shown = shown[:25] + "..." + shown[-24:]
    return (
        f"1 validation error for {model}\n{field}\n"
        f"  {msg} [type={kind}, input_value={shown}, input_type={type(value).__name__}]\n"
        f"    For further information visit https://errors.pydantic.dev/2.12/v/{kind}"
    )


class _Invalid(Exception):
    """An event vLLM's pydantic model rejects."""


def _audio(event: dict[str, Any]) -> str:
    if "audio" not in event:
        raise _Invalid(_pydantic_error("InputAudioBufferAppend", "audio", "missing",
                                       "Field required", event))  # fmt: skip
    value = event["audio"]
    if not isinstance(value, str):
        raise _Invalid(_pydantic_error("InputAudioBufferAppend", "audio", "string_type",
                                       "Input should be a valid string", value))  # fmt: skip
    return value


def _final(event: dict[str, Any]) -> bool:
    """``final: bool = False`` in pydantic's lax mode."""
    value = event.get("final", False)
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in BOOL_STRINGS:
        return BOOL_STRINGS[value.lower()]
    kind, msg = "bool_type", "Input should be a valid boolean"
    if isinstance(value, int | float | str):
        kind, msg = "bool_parsing", "Input should be a valid boolean, unable to interpret input"
    raise _Invalid(_pydantic_error("InputAudioBufferCommit", "final", kind, msg, value))


def _pcm(audio: str) -> bytes | None:
    """The chunk's PCM16 bytes, or None where vLLM answers ``invalid_audio``."""
    try:
        pcm = base64.b64decode(audio)
    except (binascii.Error, ValueError):
        return None
    samples = len(pcm) // 2
    if len(pcm) % 2 or samples == 0 or samples / 1024**2 > MAX_CHUNK_MB:
        return None
    return pcm


class RealtimeSession:
    """One WebSocket: vLLM's ``RealtimeConnection``, with the engine request in place of the
    model's streaming input."""

    def __init__(self, sim: Sim, websocket: WebSocket) -> None:
        self.sim = sim
        self.ws = websocket
        self.connection_id = f"ws-{uuid.uuid4()}"
        self.audio: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: the audio ended
        self.task: asyncio.Task[None] | None = None
        self.validated = False

    async def run(self) -> None:
        await self.ws.accept()
        await self._send({"type": "session.created", "id": f"sess-{uuid.uuid4().hex}",
                          "created": int(time.time())})  # fmt: skip
        try:
            while True:
                message = await self.ws.receive()
                text = message.get("text")
                if message["type"] == "websocket.disconnect" or text is None:
                    return
                try:
                    await self._handle(json.loads(text))
                except json.JSONDecodeError:
                    await self._error("Invalid JSON", "invalid_json")
                except Exception as exc:  # vLLM answers any failure of an event this way
                    log.debug("realtime event failed: %s", exc)
                    await self._error(str(exc), "processing_error")
        except WebSocketDisconnect:
            return
        finally:
            if self.task is not None:
                self.task.cancel()

    async def _send(self, event: dict[str, Any]) -> None:
        await self.ws.send_text(_dump(event))

    async def _error(self, message: str, code: str) -> None:
        await self._send({"type": "error", "error": message, "code": code})

    async def _handle(self, event: Any) -> None:
        if not isinstance(event, dict):  # vLLM calls event.get()
            raise AttributeError(f"'{type(event).__name__}' object has no attribute 'get'")
        kind = event.get("type")
        if kind == "session.update":
            model = event.get("model")
            if model is None:
                await self._error("Missing required field: model", "invalid_event")
            elif model and model not in self.sim.settings.models:  # "" passes, as in vLLM
                await self._error(f"The model `{model}` does not exist.", "model_not_found")
            else:
                self.validated = True
        elif kind == "input_audio_buffer.append":
            pcm = _pcm(_audio(event))
            if pcm is None:
                await self._error("Invalid audio data", "invalid_audio")
            else:
                self.audio.put_nowait(pcm)
        elif kind == "input_audio_buffer.commit":
            if not self.validated:
                await self._error(NOT_VALIDATED, "model_not_validated")
            elif _final(event):
                self.audio.put_nowait(None)
            elif self.task is None or self.task.done():  # vLLM ignores a commit meanwhile
                self.task = asyncio.create_task(self._transcribe())
        else:
            await self._error(f"Unknown event type: {kind}", "unknown_event")

    async def _transcribe(self) -> None:
        """One utterance: the audio up to the final commit, then the engine's tokens."""
        pcm = bytearray()
        while (chunk := await self.audio.get()) is not None:
            pcm += chunk
        s = self.sim.settings
        frames = min(-(-len(pcm) // FRAME_BYTES) + DELAY_FRAMES, s.max_model_len - len(PREFIX))
        seed = hash((s.seed, zlib.crc32(pcm)))  # the same audio, the same words
        wake = asyncio.Event()
        req = EngineRequest(
            id=f"rt-{self.connection_id}-{uuid.uuid4()}", prompt=list(PREFIX),
            output=Output(seed, max_tokens=frames, prompt=PREFIX), arrival=time.monotonic(),
            max_tokens=frames, notify=wake.set,
        )  # fmt: skip
        try:
            self.sim.engine.submit(req)
            text, sent = "", 0
            while True:
                out = req.output
                for t in range(sent, len(out.ids)):
                    word = t % TEXT_EVERY == TEXT_EVERY - 1
                    delta = out.deltas[t // TEXT_EVERY] if word else ""
                    text += delta
                    await self._send({"type": "transcription.delta", "delta": delta})
                sent = len(out.ids)
                if req.error is not None:
                    await self._error(req.error, "processing_error")
                    return
                if req.done:
                    break
                await wake.wait()
                wake.clear()
            usage = formats.usage(len(PREFIX), sent, details=True)
            await self._send({"type": "transcription.done", "text": text, "usage": usage})
            while not self.audio.empty():  # vLLM drops audio sent meanwhile
                self.audio.get_nowait()
        except EngineDead as exc:
            await self._error(str(exc), "processing_error")
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client left while we wrote
        finally:
            if not req.done:
                self.sim.engine.abort(req)


def route(sim: Sim) -> WebSocketRoute:
    """``/v1/realtime`` for ``sim``: served whatever the model (vLLM only with a realtime one)."""

    async def session(websocket: WebSocket) -> None:
        await RealtimeSession(sim, websocket).run()

    return WebSocketRoute(PATH, session)
