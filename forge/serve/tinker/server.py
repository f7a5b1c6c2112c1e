"""The Tinker API over HTTP (`forge serve`): the routes tinker 0.38.0's SDK calls, on Starlette.

Sessions hold training models (forge.serve.tinker.tenants) and samplers; a session whose client
stops sending heartbeats is closed with everything it holds. Every request carries the server's
key in `X-API-Key`; one without it is refused. Work that takes time (creating a model, a pass,
a step, saving, sampling) answers with a request id at once and runs in the background
(forge.serve.tinker.futures); a bad request fails its future with one line naming the cause,
and every other session goes on.
"""

import asyncio
import contextlib
import hmac
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from forge.models import resolve_model
from forge.observability.console import say
from forge.serve.tinker.config import ServeConfig
from forge.serve.tinker.futures import Binary, Futures, QueueFull, UserError, one_line
from forge.serve.tinker.tenants import ModelSpec, Tenant
from forge.serve.tinker.wire import PROTOBUF, WireError, read_forward_backward

API = "/api/v1"
SCHEME = "tinker://"
# Options of a sample request this server does not serve (top-k logprobs and their kin).
_UNSERVED_SAMPLING = (
    "topk_prompt_logprobs",
    "topk_sample_logprobs",
    "prompt_alt_tokens_k",
    "prompt_logprobs_last_n",
    "target_prompt_logprobs",
)


class Refused(UserError):
    """A request answered at once with an HTTP error: `status` and one line. Raised by the
    work of a request that has a request id (one in a model's seq_id order), it fails that
    request instead, as a user error."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class Session:
    """A client's session: its training models (by model id) and its heartbeat."""

    session_id: str
    last_seen: float = field(default_factory=time.monotonic)
    models: list[str] = field(default_factory=list)


@dataclass
class Sampler:
    """A sampling session: a version of a training model's weights."""

    model_id: str
    version: int
    base_model: str
    path: str | None = None


class TinkerServer:
    """The server's state and its routes.

    Args:
        cfg: the server's settings.
        api_key: the key every request must carry.
        shm: the shared-memory folder the models' weight versions go through.
    """

    def __init__(self, cfg: ServeConfig, api_key: str, shm: Path) -> None:
        self.cfg = cfg
        self.api_key = api_key
        self.shm = shm
        self.futures = Futures()
        self.sessions: dict[str, Session] = {}
        self.tenants: dict[str, Tenant] = {}
        self.samplers: dict[str, Sampler] = {}
        self._starting = 0  # models being created, counted against max_models
        self._refusals = itertools.count(1)

    def app(self) -> Starlette:
        """The Starlette application."""
        post = {
            "client/config": self.client_config,
            "client/dynamic_config": self.client_config,
            "create_session": self.create_session,
            "session_heartbeat": self.session_heartbeat,
            "telemetry": self.telemetry,
            "create_model": self.create_model,
            "get_info": self.get_info,
            "forward_backward": self.forward_backward,
            "optim_step": self.optim_step,
            "save_weights": self.save_weights,
            "save_weights_for_sampler": self.save_weights_for_sampler,
            "load_weights": self.load_weights,
            "create_sampling_session": self.create_sampling_session,
            "asample": self.asample,
            "retrieve_future": self.retrieve_future,
            "sessions/{session_id}/finish": self.finish_session,
        }
        get = {
            "healthz": self.healthz,
            "get_server_capabilities": self.capabilities,
            "samplers/{sampler_id}": self.get_sampler,
        }
        routes = [Route(f"{API}/{p}", self._guarded(f), methods=["POST"]) for p, f in post.items()]
        routes += [Route(f"{API}/{p}", self._guarded(f), methods=["GET"]) for p, f in get.items()]
        routes.append(Route("/{path:path}", self._guarded(self.unserved), methods=["GET", "POST"]))
        return Starlette(routes=routes)

    def _guarded(self, handler: Any) -> Any:
        """`handler` behind the key check, its Refused raised as an HTTP error (JSON body:
        the SDK shows `detail`)."""

        async def route(request: Request) -> Response:
            given = request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                if next(self._refusals) <= 3:  # said, without flooding the console
                    say(f"forge serve: refused {request.url.path} from {_client(request)}: no key")
                return JSONResponse({"detail": "missing or wrong X-API-Key"}, status_code=401)
            try:
                answer = await handler(request)
            except Refused as refused:
                return JSONResponse({"detail": refused.detail}, status_code=refused.status)
            except (ValueError, TypeError) as error:  # a field of the wrong kind: not retried
                detail = f"{request.url.path}: {one_line(error)}"
                return JSONResponse({"detail": detail}, status_code=400)
            return answer if isinstance(answer, Response) else JSONResponse(answer)

        return route

    # --- the client and its session -----------------------------------------------------------

    async def client_config(self, request: Request) -> dict:
        return {}  # every flag at the SDK's default

    async def create_session(self, request: Request) -> dict:
        session_id = f"forge-{uuid.uuid4().hex[:12]}"
        self.sessions[session_id] = Session(session_id)
        return {"session_id": session_id, "type": "create_session"}

    async def session_heartbeat(self, request: Request) -> Response:
        body = await _json(request)
        session = self.sessions.get(body.get("session_id", ""))
        if session is None:  # 410 stops the SDK's heartbeats: the session is over
            return JSONResponse({"detail": "no such session (closed?)"}, status_code=410)
        session.last_seen = time.monotonic()
        return JSONResponse({"type": "session_heartbeat"})

    async def telemetry(self, request: Request) -> dict:
        return {"status": "accepted"}  # not kept: forge's own metrics are the run's

    async def finish_session(self, request: Request) -> dict:
        await self.close_session(request.path_params["session_id"])
        return {}

    async def close_session(self, session_id: str) -> None:
        """Closes the session's models (their processes and memory) and samplers."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        for model_id in session.models:
            if (tenant := self.tenants.pop(model_id, None)) is not None:
                await tenant.close()
        for sampler_id in [s for s, x in self.samplers.items() if x.model_id in session.models]:
            del self.samplers[sampler_id]

    async def reap(self) -> None:
        """Closes the sessions whose heartbeats stopped; runs until cancelled."""
        while True:
            await asyncio.sleep(min(self.cfg.heartbeat_timeout_s / 4, 5.0))
            deadline = time.monotonic() - self.cfg.heartbeat_timeout_s
            for session_id in [s for s, x in self.sessions.items() if x.last_seen < deadline]:
                say(f"forge serve: session {session_id} sent no heartbeat: closed")
                await self.close_session(session_id)

    # --- models --------------------------------------------------------------------------------

    async def create_model(self, request: Request) -> dict:
        body = await _json(request)
        session = self._session(body)
        model_id = f"{session.session_id}:train:{_int(body, 'model_seq_id')}"
        lora = body.get("lora_config") or {}
        spec = ModelSpec(
            base_model=self._base(body.get("base_model")),
            rank=int(lora.get("rank", 32)),
            train_attn=bool(lora.get("train_attn", True)),
            train_mlp=bool(lora.get("train_mlp", True)),
            seed=int(lora.get("seed") or 0),
        )
        work = self._start(session, model_id, spec)
        return {"request_id": self.futures.submit(work), "model_id": model_id}

    async def _start(
        self, session: Session, model_id: str, spec: ModelSpec, state: tuple | None = None
    ) -> dict:
        if len(self.tenants) + self._starting >= self.cfg.max_models:
            raise UserError(f"the server holds max_models={self.cfg.max_models} models already")
        spec.lora(self.cfg.lora_alpha)  # a bad adapter shape fails before any process starts
        self._starting += 1
        try:
            tenant = await Tenant.start(model_id, spec, self.cfg, self.futures, self.shm)
        finally:
            self._starting -= 1
        try:
            if state is not None:
                await tenant.load_state(*state)
        except BaseException:
            await tenant.close()
            raise
        if session.session_id not in self.sessions:  # closed while the model started
            await tenant.close()
            raise UserError(f"session {session.session_id} was closed")
        self.tenants[model_id] = tenant
        session.models.append(model_id)
        say(f"forge serve: model {model_id} on {spec.base_model} (LoRA rank {spec.rank})")
        kind = "create_model" if state is None else "load_weights"
        return {"model_id": model_id, "type": kind}

    async def get_info(self, request: Request) -> dict:
        tenant = self._tenant(await _json(request))
        base = tenant.spec.base_model
        return {
            "type": "get_info",
            "model_id": tenant.model_id,
            "model_data": {"model_name": base, "tokenizer_id": str(resolve_model(base))},
            "is_lora": True,
            "lora_rank": tenant.spec.rank,
            "model_name": base,
        }

    async def capabilities(self, request: Request) -> dict:
        models = [
            {"model_name": m, "trainable": True, "sampleable": True} for m in self.cfg.base_models
        ]
        return {"supported_models": models}

    async def healthz(self, request: Request) -> dict:
        return {"status": "ok"}

    async def unserved(self, request: Request) -> Response:
        return JSONResponse(
            {"detail": f"forge serve does not serve {request.method} {request.url.path}"},
            status_code=404,
        )

    # --- training ------------------------------------------------------------------------------

    async def forward_backward(self, request: Request) -> dict:
        try:
            message = read_forward_backward(await request.body())
        except WireError as error:
            raise Refused(400, str(error)) from None
        tenant = self._tenant({"model_id": message.model_id})
        request_id = self._ordered(tenant, message.seq_id, lambda: tenant.forward_backward(message))
        return {"request_id": request_id, "model_id": tenant.model_id}

    async def optim_step(self, request: Request) -> dict:
        body = await _json(request)
        tenant = self._tenant(body)

        async def step() -> dict:
            adam = body.get("adam_params")
            if not isinstance(adam, dict):
                raise UserError("optim_step: only adam_params are served")
            return await tenant.optim_step(adam)

        request_id = self._ordered(tenant, _int(body, "seq_id"), step)
        return {"request_id": request_id, "model_id": tenant.model_id}

    def _ordered(self, tenant: Tenant, seq_id: int, work: Any) -> str:
        try:
            return tenant.order.submit(seq_id, work)
        except UserError as error:
            raise Refused(400, str(error)) from None
        except QueueFull as error:
            raise Refused(429, str(error)) from None

    # --- weights and samplers ------------------------------------------------------------------

    async def save_weights(self, request: Request) -> dict:
        body = await _json(request)
        tenant = self._tenant(body)

        async def save() -> dict:
            name = _name(body)
            await tenant.save_state(name)
            return {"path": f"{SCHEME}{tenant.model_id}/weights/{name}", "type": "save_weights"}

        return {"request_id": self._ordered(tenant, _int(body, "seq_id"), save)}

    async def save_weights_for_sampler(self, request: Request) -> dict:
        body = await _json(request)
        tenant = self._tenant(body)
        session = self._session({"session_id": tenant.model_id.split(":train:")[0]})

        async def save() -> dict:
            # save_weights_and_get_sampling_client names no path: the sampler is made here.
            if body.get("path") is None:
                sampler_id = f"{session.session_id}:sample:{_int(body, 'sampling_session_seq_id')}"
            else:
                sampler_id = f"{SCHEME}{tenant.model_id}/sampler_weights/{_name(body)}"
            version = await tenant.save_for_sampler()
            path = sampler_id if body.get("path") is not None else None
            self.samplers[sampler_id] = Sampler(
                tenant.model_id, version, tenant.spec.base_model, path
            )
            if path is None:
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
            return {"path": path, "type": "save_weights_for_sampler"}

        return {"request_id": self._ordered(tenant, _int(body, "seq_id"), save)}

    async def load_weights(self, request: Request) -> dict:
        body = await _json(request)
        if "model_id" in body:
            raise Refused(
                400,
                "load_state on a live model is not served: create a training "
                "client from the state instead",
            )
        session = self._session(body)
        source, kind, name = _tinker_path(body.get("path"))
        if kind != "weights":
            raise Refused(400, f"load_weights needs a saved state (…/weights/NAME), got {kind}")
        folder = Path(self.cfg.state_dir) / "models" / source
        try:
            spec = ModelSpec(**json.loads((folder / "model.json").read_text()))
            step = json.loads((folder / "states.json").read_text())[name]
        except (OSError, KeyError):
            raise Refused(404, f"no saved state {body['path']} on this server") from None
        model_id = f"{session.session_id}:train:{_int(body, 'model_seq_id')}"
        state = (folder, step, bool(body.get("optimizer", True)))
        work = self._start(session, model_id, spec, state)
        return {"request_id": self.futures.submit(work), "model_id": model_id}

    async def create_sampling_session(self, request: Request) -> dict:
        body = await _json(request)
        session = self._session(body)
        path = body.get("model_path")
        if path is None:
            raise Refused(
                400,
                "samplers of a base model alone are not served: save a training "
                "model's weights for a sampler",
            )
        sampler = self.samplers.get(path)
        if sampler is None:
            raise Refused(404, f"no sampler weights {path} on this server")
        sampler_id = f"{session.session_id}:sample:{_int(body, 'sampling_session_seq_id')}"
        self.samplers[sampler_id] = sampler
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    async def get_sampler(self, request: Request) -> dict:
        sampler = self._sampler(request.path_params["sampler_id"])
        return {
            "sampler_id": request.path_params["sampler_id"],
            "base_model": sampler.base_model,
            "model_path": sampler.path,
        }

    async def asample(self, request: Request) -> dict:
        body = await _json(request)
        sampler = self._sampler(body.get("sampling_session_id", ""))
        tenant = self.tenants.get(sampler.model_id)
        if tenant is None:
            raise Refused(404, f"the model of sampler {body['sampling_session_id']} is closed")
        n = _int(body, "num_samples")
        prompt = _prompt_tokens(body.get("prompt") or {})
        if unserved := [k for k in _UNSERVED_SAMPLING if body.get(k)]:
            raise Refused(400, f"sampling with {', '.join(unserved)} is not served")
        if body.get("prompt_logprobs"):  # compute_logprobs
            work = tenant.prompt_logprobs(sampler.version, prompt)
        else:
            work = tenant.sample(sampler.version, prompt, n, self._sampling(body))
        request_id = self.futures.submit(work)
        ids = [f"{request_id}:{i}" for i in range(n)]
        return {"request_id": request_id, "sample_sequence_ids": ids}

    def _sampling(self, body: dict) -> dict[str, Any]:
        """The request's sampling parameters as the Generator takes them."""
        params = body.get("sampling_params") or {}
        sampling: dict[str, Any] = {
            "temperature": float(params.get("temperature", 1.0)),
            "top_p": float(params.get("top_p", 1.0)),
            "top_k": max(int(params.get("top_k", -1)), 0),  # the SDK's -1 (off) is vLLM's 0
        }
        for key in ("max_tokens", "seed"):
            if params.get(key) is not None:
                sampling[key] = int(params[key])
        stop = params.get("stop")
        if stop == []:  # no stop at all, the end-of-sequence token included
            sampling["ignore_eos"] = True
        elif isinstance(stop, str):
            sampling["stop"] = [stop]
        elif stop and all(isinstance(s, int) for s in stop):
            sampling["stop_token_ids"] = list(stop)
        elif stop:
            sampling["stop"] = [str(s) for s in stop]
        return sampling

    async def retrieve_future(self, request: Request) -> Response:
        request_id = (await _json(request)).get("request_id", "")
        if not self.futures.known(request_id):
            raise Refused(404, f"no request {request_id!r} (finished long ago, or never made)")
        result = await self.futures.retrieve(request_id)
        if isinstance(result, Binary):
            return Response(result.body, media_type=PROTOBUF)
        return JSONResponse(result)

    # --- look-ups ------------------------------------------------------------------------------

    def _session(self, body: dict) -> Session:
        session = self.sessions.get(body.get("session_id", ""))
        if session is None:
            raise Refused(404, f"no session {body.get('session_id')!r} (closed?)")
        session.last_seen = time.monotonic()
        return session

    def _tenant(self, body: dict) -> Tenant:
        tenant = self.tenants.get(body.get("model_id", ""))
        if tenant is None:
            raise Refused(404, f"no model {body.get('model_id')!r} on this server (closed?)")
        # A client at work is alive, whether or not its heartbeats got through.
        self._session({"session_id": tenant.model_id.split(":train:")[0]})
        return tenant

    def _sampler(self, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise Refused(404, f"no sampler {sampler_id!r} on this server")
        return sampler

    def _base(self, name: Any) -> str:
        """A served model's name, or a local folder holding one: a client that loads its
        tokenizer from that folder (tinker-cookbook does) sends the folder as its model."""
        if name in self.cfg.base_models:
            return name
        if isinstance(name, str) and name.startswith("/"):
            with contextlib.suppress(ValueError):
                if resolve_model(name) in {resolve_model(m) for m in self.cfg.base_models}:
                    return name
        served = ", ".join(self.cfg.base_models)
        raise Refused(400, f"base_model {name!r} is not served here (serving: {served})")


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise Refused(400, f"{request.url.path}: the body is not JSON") from None
    if not isinstance(body, dict):
        raise Refused(400, f"{request.url.path}: the body is not a JSON object")
    return body


def _int(body: dict, key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise Refused(400, f"{key} must be an integer, got {value!r}")
    return value


def _name(body: dict) -> str:
    name = body.get("path")
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise Refused(400, f"a checkpoint name must be a plain name, got {name!r}")
    return name


def _tinker_path(path: Any) -> tuple[str, str, str]:
    """(model id, kind, name) of `tinker://MODEL/KIND/NAME`."""
    parts = path[len(SCHEME) :].split("/") if isinstance(path, str) else []
    if not isinstance(path, str) or not path.startswith(SCHEME) or len(parts) != 3:
        raise Refused(400, f"not a tinker://MODEL/KIND/NAME path: {path!r}")
    return parts[0], parts[1], parts[2]


def _prompt_tokens(prompt: dict) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.get("chunks") or []:
        if chunk.get("type") != "encoded_text":
            raise Refused(400, f"only text prompts are served, not {chunk.get('type')!r}")
        tokens += [int(t) for t in chunk.get("tokens") or []]
    if not tokens:
        raise Refused(400, "the prompt has no tokens")
    return tokens


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"
