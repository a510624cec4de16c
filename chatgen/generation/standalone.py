"""`chatgen.VLLMGeneration`: vLLM generation for any PyTorch trainer: `generate` token ids,
`sync_weights` from a model.

    from chatgen import VLLMGeneration
    gen = VLLMGeneration("outputs/tiny-llama-sft", max_completion_length=16)      # colocate: engine in this process
    gen = VLLMGeneration("outputs/tiny-llama-sft", mode="server", server_base_url="http://127.0.0.1:8000",
                         api_key=KEY)                                        # a `chatgen serve --control` server
    prompt_ids, completion_ids, logprobs = gen.generate([[1, 77, 5, 9]], num_generations=4)
    ...a training step on a transformers model...
    gen.sync_weights(model)                  # nn.Module (HF names; DDP/FSDP/compile unwrapped), (name, tensor) pairs,
                                             # or a chatgen MegatronModule

The generator knows nothing of the trainer: it is built from generation parameters and fed weights.
Colocate mode runs a `VLLMModule` in this process and writes weights with
`chatgen.param_sync.sync_weights`. Server mode sends `/v1/completions` requests to a server and
pushes weights through its control endpoints (chatgen/serving/control.py): through a file in
/dev/shm that both processes map when the server is on this machine (`weight_transport="shm"`), else
over a private torch.distributed group (`"group"`); `"auto"` picks. Either way the manifest and
finiteness are checked before anything is written: a refused sync leaves the engine on its old
weights. Guide and example: docs/vllm_generation.md, examples/grpo_with_hf_trainer.py.
"""

import dataclasses

import torch

from chatgen.core.distributed import LOOPBACK_HOSTS
from chatgen.param_sync import GroupSender, SharedMemoryUnavailable, ShmSender, sync_weights

MODES = ("colocate", "server")
WEIGHT_TRANSPORTS = ("auto", "shm", "group")


class VLLMGeneration:
    """A vLLM engine on the HF model directory `model` (colocate), or a client of one (server), with
    default sampling set at construction (each `generate` call may override it).

    Sampling: temperature, top_p, top_k (0 = off), min_p, repetition_penalty; max_completion_length
    tokens per completion, stopping at EOS (kept in the completion). logprobs: 0 = return the
    log-prob of each sampled token (the only value supported). Colocate only (a server's engine is
    configured where it starts): tensor_parallel_size; max_model_length, prompt + completion tokens
    at most (None = the model's max_position_embeddings; a longer prompt than max_model_length -
    max_completion_length is an error); engine_kwargs, further per-model generation keys
    (docs/generation_keys.md), e.g. dtype, seed, kv_cache_memory_bytes, enforce_eager, logprobs_mode
    ("raw" makes log-probs those of the untempered model, what a trainer computes; the default
    "processed" is after temperature / top-k / top-p). Server: server_base_url (e.g.
    "http://127.0.0.1:8000") and api_key of a `chatgen serve --control` server; weight_transport,
    how sync_weights moves the weights: "shm" (a file in /dev/shm both processes map: one copy; the
    server must be on this machine, run by this user), "group" (a torch.distributed group: gloo over
    TCP on CPU, NCCL on GPU; any machine), "auto" (shm when server_base_url is a loopback address,
    CUDA is not in use and the server's /dev/shm directory is reachable from here, else group);
    request_timeout, the seconds any HTTP call to the server may wait for it (to connect, and
    between bytes of the answer: a generate call waits for its whole batch, a weight update for the
    engine's load): a stalled server raises TimeoutError instead of hanging the trainer.
    """

    def __init__(
        self,
        model,
        mode="colocate",
        *,
        server_base_url=None,
        api_key=None,
        weight_transport="auto",
        request_timeout=600.0,
        tensor_parallel_size=1,
        max_model_length=None,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        max_completion_length=16,
        logprobs=0,
        **engine_kwargs,
    ):
        if mode not in MODES:
            raise ValueError(f"VLLMGeneration: mode={mode!r} is not one of {MODES}")
        if logprobs != 0:
            raise ValueError(
                f"VLLMGeneration: logprobs={logprobs!r}; only 0 (the sampled token's log-prob) is "
                "supported"
            )
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"VLLMGeneration: weight_transport={weight_transport!r} is not one of {WEIGHT_TRANSPORTS}"
            )
        if mode == "colocate" and weight_transport != "auto":
            raise ValueError(
                f"VLLMGeneration: weight_transport={weight_transport!r} is for mode='server'; in colocate "
                "mode the engine is in this process and reads the weights where they are"
            )
        self.mode = mode
        self.sampling = dict(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_tokens=max_completion_length,
        )
        check_sampling(self.sampling, "VLLMGeneration")
        self.module = self.server = None
        if mode == "server":
            engine_args = {
                **engine_kwargs,
                **(
                    {"tensor_parallel_size": tensor_parallel_size}
                    if tensor_parallel_size != 1
                    else {}
                ),
                **({"max_model_length": max_model_length} if max_model_length is not None else {}),
            }
            if engine_args:
                raise ValueError(
                    f"VLLMGeneration(mode='server'): {', '.join(sorted(engine_args))} configure the "
                    "engine, which the server owns; set them where it starts (`chatgen serve "
                    "--config ... key=value`)"
                )
            if not server_base_url:
                raise ValueError(
                    "VLLMGeneration(mode='server') needs server_base_url, e.g. 'http://127.0.0.1:8000' "
                    "(a `chatgen serve --control` server)"
                )
            from urllib.parse import urlparse

            if not request_timeout > 0:
                raise ValueError(
                    f"VLLMGeneration: request_timeout={request_timeout!r}; give the seconds an HTTP call "
                    "to the server may wait, e.g. 600"
                )
            self.server = _Server(server_base_url, api_key, request_timeout)
            self.weight_transport = weight_transport
            # auto: shm for a loopback server on a CPU machine (on GPUs NCCL moves the weights
            # device to device, without two trips through host memory); the first sync falls back to
            # the group if the server's file cannot be created from here
            shm = weight_transport == "shm" or (
                weight_transport == "auto"
                and not torch.cuda.is_available()
                and urlparse(self.server.base_url).hostname in LOOPBACK_HOSTS
            )
            self._transport = "shm" if shm else "group"
            self._shm = ShmSender(self._begin_shm, self._finish_shm)
            self._group = GroupSender.to(
                "", 0, "", begin=self._begin_group, finish=self._finish_group
            )
            self._mode = "wait"  # the mode of the sync in progress (the handshakes' begin sends it)
            return
        # imports vLLM: server mode needs no engine here
        from chatgen.generation.vllm.module import (
            VLLMModule,
        )

        config = dict(
            load=str(model),
            tensor_parallel_size=tensor_parallel_size,
            seq_length=max_model_length,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k or -1,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            new_token_limit=True,
            max_new_tokens=max_completion_length,
            **engine_kwargs,
        )
        self.module = VLLMModule(config, name="generation").start()

    def generate(
        self,
        prompts,
        num_generations=1,
        greedy=False,
        *,
        temperature=None,
        top_p=None,
        top_k=None,
        min_p=None,
        repetition_penalty=None,
        max_completion_length=None,
    ):
        """Sample `num_generations` completions of each prompt.

        prompts: list of prompts, each a non-empty list[int] of token ids, a string (tokenized with
        the model's tokenizer, special tokens such as BOS added, as vLLM's /v1/completions does) or
        a chat, a list of {"role", "content"} messages (rendered with the model's chat template and
        the assistant prefix, as /v1/chat/completions does); a batch may mix them. greedy: decode
        greedily (one completion per prompt: num_generations must be 1). temperature, top_p, top_k
        (0 = off), min_p, repetition_penalty, max_completion_length: this call's sampling, where
        given (else the constructor's). Returns (prompt_ids, completion_ids, logprobs): three lists
        of len(prompts) * num_generations entries, prompt-major (completion j of prompt i at i *
        num_generations + j): the prompt's ids, the completion's ids (ending with EOS unless the
        length limit stopped it), and the log-prob of each completion token (list[float], same
        length).
        """
        if num_generations < 1:
            raise ValueError(f"generate: num_generations={num_generations}; ask for at least 1")
        if greedy and num_generations > 1:
            raise ValueError(
                f"generate: greedy decoding gives one completion per prompt; got num_generations="
                f"{num_generations}: pass num_generations=1, or greedy=False to sample"
            )
        given = dict(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_tokens=max_completion_length,
        )
        sampling = {**self.sampling, **{k: v for k, v in given.items() if v is not None}}
        check_sampling(sampling, "generate")
        if sampling["temperature"] == 0 and num_generations > 1:
            raise ValueError(
                f"generate: temperature=0 decodes greedily, one completion per prompt; got "
                f"num_generations={num_generations}: pass num_generations=1, or a positive temperature"
            )
        prompts = self._prompt_ids(prompts)
        if self.server is not None:
            choices = self.server.post(
                "/v1/completions",
                {
                    "prompt": prompts,
                    "n": num_generations,
                    **sampling,
                    **({"temperature": 0.0} if greedy else {}),
                },
            )["choices"]
            choices.sort(key=lambda c: c["index"])  # index = prompt * n + sample: prompt-major
            return (
                [c["prompt_token_ids"] for c in choices],
                [c["token_ids"] for c in choices],
                [c["generation_log_probs"] for c in choices],
            )
        module = self.module
        constructed = module.config
        module.config = dataclasses.replace(
            constructed,
            n=num_generations,
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            top_k=sampling["top_k"] or -1,
            min_p=sampling["min_p"],
            repetition_penalty=sampling["repetition_penalty"],
            max_new_tokens=sampling["max_tokens"],
        )
        try:  # sampling keys are read per call: this call's, then the constructor's again
            width = max(map(len, prompts))
            input_ids = torch.full((len(prompts), width), module.pad_token_id, dtype=torch.long)
            for i, p in enumerate(prompts):
                input_ids[i, : len(p)] = torch.tensor(p)
            out = module.generate(
                {"input_ids": input_ids, "input_lengths": torch.tensor(list(map(len, prompts)))},
                greedy=greedy,
            )
        finally:
            module.config = constructed
        prompt_ids, completion_ids, logprobs = [], [], []
        ends, generated = (
            out["unpadded_sequence_lengths"].tolist(),
            out["generation_lengths"].tolist(),
        )
        for row, (end, n) in enumerate(zip(ends, generated)):
            prompt_ids.append(out["output_ids"][row, : end - n].tolist())
            completion_ids.append(out["output_ids"][row, end - n : end].tolist())
            logprobs.append(out["logprobs"][row, end - n : end].tolist())
        return prompt_ids, completion_ids, logprobs

    def _prompt_ids(self, prompts) -> list:
        """Each prompt as token ids: ids as given, a string tokenized, a chat rendered with the
        chat template (the server's /tokenize in server mode, so the server's tokenizer decides)."""
        if (
            isinstance(prompts, (str, dict))
            or not isinstance(prompts, (list, tuple))
            or not prompts
        ):
            raise ValueError(
                f"generate: prompts must be a non-empty list of prompts (token ids, strings or chats), "
                f"got {prompts!r:.80}"
            )
        ids = []
        for i, p in enumerate(prompts):
            if isinstance(p, str) and p:
                ids.append(self._tokenize({"prompt": p}))
            elif isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p):
                if not all(isinstance(m.get("role"), str) and "content" in m for m in p):
                    raise ValueError(
                        f"generate: prompts[{i}] is a chat whose messages need 'role' and 'content', "
                        f"got {p!r:.120}"
                    )
                ids.append(self._tokenize({"messages": list(p), "add_generation_prompt": True}))
            elif isinstance(p, (list, tuple)) and p and all(type(t) is int for t in p):
                ids.append(list(p))
            else:
                raise ValueError(
                    f"generate: prompts[{i}] must be a non-empty list of token ids (int), a non-empty "
                    f"string or a chat (a list of {{'role', 'content'}} messages), got {p!r:.80}"
                )
        return ids

    def _tokenize(self, request: dict) -> list:
        """The token ids of a /tokenize request body ({"prompt"} or {"messages",
        "add_generation_prompt"})."""
        if self.server is not None:
            return self.server.post("/tokenize", request)["tokens"]
        tokenizer = self.module.tokenizer
        if tokenizer is None:
            raise ValueError(
                "generate: text and chat prompts need a tokenizer, and this model has none; pass token "
                "ids"
            )
        if "prompt" in request:
            return tokenizer.encode(request["prompt"])
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "generate: a chat prompt needs a chat template, and this model's tokenizer has none; "
                "pass a string or token ids"
            )
        # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its
        # keys
        return list(
            tokenizer.apply_chat_template(
                request["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    def sync_weights(self, source, mode="wait"):
        """Write `source`'s weights into the engine; returns a `chatgen.param_sync.SyncReport`.

        source: a `torch.nn.Module` with Hugging Face parameter names (a transformers model; DDP /
        FSDP / torch.compile wrappers unwrapped), an iterable of (HF name, tensor), or a chatgen
        `MegatronModule`. Names, shapes and finiteness are checked before anything is written: on a
        mismatch a `SyncError` names the parameters and the engine keeps its old weights. No request
        is served KV computed with the old weights afterwards. mode: what requests in flight on the
        engine do (VLLMModule.update_weights: wait, keep, recompute, abort); in colocate mode none
        are (generate returns when its requests are done). Server mode with a multi-process trainer:
        call it on every rank (only rank 0 talks to the server).
        """
        if self.server is None:
            return sync_weights(source, self.module, mode=mode)
        self._mode = mode
        if self._transport == "shm":
            try:
                return self._shm.send(source)
            except (
                SharedMemoryUnavailable
            ):  # raised before anything was sent: the group can still carry it
                if self.weight_transport == "shm":
                    raise
                self._transport = "group"
        return self._group.send(source)

    # The handshakes of `chatgen serve --control` (chatgen/serving/control.py), called by the
    # senders on rank 0.

    def _begin_shm(self, held: str | None) -> str:
        """POST /control/weights/begin of a shm sync: the path to write (`held`, the file still
        mapped, or new)."""
        body = {"mode": self._mode, "transport": "shm", "path": held}
        return self.server.post("/control/weights/begin", body)["path"]

    def _finish_shm(self, body: dict) -> str | None:
        """POST /control/weights/finish of a shm sync: None once the weights are in, else the
        server's reason."""
        answer = self.server.post("/control/weights/finish", body, check=False)
        return answer["error"]["message"] if "error" in answer else None

    def _begin_group(self, held: int | None) -> dict:
        """POST /control/weights/begin of a group sync: the rendezvous and this update's one-time
        token (`held`: the port of the group still open)."""
        return self.server.post(
            "/control/weights/begin", {"mode": self._mode, "transport": "group", "port": held}
        )

    def _finish_group(self, ok: bool) -> None:
        """POST /control/weights/finish of a group sync (a failure raises, unless this end failed
        first)."""
        self.server.post("/control/weights/finish", check=ok)

    def shutdown(self) -> None:
        """Stop the engine and free its memory (colocate); close the connection and the shared
        memory (server)."""
        if self.module is not None:
            self.module.shutdown()
        if self.server is not None:
            self._shm.close()
            self._group.close()
            self.server.session.close()


def check_sampling(sampling: dict, where: str) -> None:
    """A ValueError naming the argument when a sampling setting is out of range (before any
    request is made)."""
    problems = [
        (
            "temperature",
            sampling["temperature"] >= 0,
            "use 0 for greedy decoding, or a positive temperature",
        ),
        ("top_p", 0 < sampling["top_p"] <= 1, "use a value in (0, 1]; 1.0 turns top-p off"),
        (
            "top_k",
            isinstance(sampling["top_k"], int) and sampling["top_k"] >= 0,
            "use 0 to turn top-k off, or a positive count",
        ),
        ("min_p", 0 <= sampling["min_p"] <= 1, "use a value in [0, 1]; 0 turns min-p off"),
        (
            "repetition_penalty",
            sampling["repetition_penalty"] > 0,
            "use a positive value; 1.0 turns it off",
        ),
        (
            "max_completion_length",
            isinstance(sampling["max_tokens"], int) and sampling["max_tokens"] >= 1,
            "ask for at least 1 token",
        ),
    ]
    for name, ok, fix in problems:
        if not ok:
            value = sampling["max_tokens" if name == "max_completion_length" else name]
            raise ValueError(f"{where}: {name}={value!r}; {fix}")


class _Server:
    """HTTP calls to a `chatgen serve` server, with its API key and a timeout; errors carry the
    server's message."""

    def __init__(self, base_url: str, api_key, timeout: float):
        import requests

        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self.session = requests.Session()
        if api_key is not None:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def post(self, path: str, body=None, check: bool = True) -> dict:
        import requests

        try:
            response = self.session.post(  # JSON even when empty: the server refuses other types
                self.base_url + path, json={} if body is None else body, timeout=self.timeout
            )
        except requests.Timeout:
            raise TimeoutError(
                f"{self.base_url}{path}: no answer within {self.timeout:g} s (VLLMGeneration's "
                "request_timeout): is the server stalled or overloaded? Raise request_timeout for "
                "long batches"
            ) from None
        if check and response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise RuntimeError(f"{self.base_url}{path}: HTTP {response.status_code}: {message}")
        return response.json() if response.content else {}
