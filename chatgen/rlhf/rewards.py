"""Rewards (`backend: python` models): plain functions of your project, a reward model, a remote
service, the shipped rules, weighted together. docs/rewards.md has every key.

    reward:                                   # one function of your own (TRL's shape), nothing else
      backend: python
      model_class: my_task/reward.py:accuracy # or my_task.reward:accuracy; a chatgen.Module class works too

    reward:                                   # several terms, weighted; each is logged as reward/<name>
      backend: python
      model_class: chatgen.rlhf.rewards:Rewards
      config:
        terms:
          accuracy: {function: math_verify}                  # a shipped one (BUILTIN)
          format:   {function: math_format, weight: 0.1}
          mine:     {function: my_task/reward.py:brevity, weight: 0.5}
          judge:    {model: outputs/reward-model}            # an HF sequence-classification checkpoint
          service:  {url: "http://127.0.0.1:8000/score", on_error: zero}

A reward function is `f(completions, **columns) -> list[float]`: `completions` are the S response
texts, `prompts` the S prompts (each record's `prompt`, or its chat `messages`), and every other
column of the data records comes as a keyword list of length S (`answer`, ...); take `**kwargs` for
the ones you do not use. Every term's output, and the run's total, go through
chatgen.rlhf.health.checked_rewards (one float per completion, finite; anything else is refused
naming the term and what it returned).
"""

import concurrent.futures
import dataclasses
import inspect
import json
import os
import queue
import socket
import threading
import time
import urllib.parse
from typing import Any, Literal, Optional

import torch

from chatgen.config import REQUIRED, opt
from chatgen.config.typed import build, did_you_mean
from chatgen.core.http_post import HTTPStatusError, RedirectRefused, post_json
from chatgen.core.imports import import_object
from chatgen.module import Module
from chatgen.rlhf.health import checked_rewards
from chatgen.tasks import REWARDS, math_words


def _rule(rule):
    """A chatgen.tasks rule `rule(response, answer) -> float` as a reward function."""

    def reward(completions, answer, **_):
        return [rule(c, a) for c, a in zip(completions, answer)]

    reward.__name__ = rule.__name__
    return reward


# the functions a term may name without a path (`function: math_verify`)
BUILTIN = {
    "math_verify": math_words.math_verify_reward,
    "math_format": math_words.math_format_reward,
    **{name: _rule(rule) for name, rule in REWARDS.items()},
}


@dataclasses.dataclass(kw_only=True)
class RewardTerm:
    """One term of `Rewards`: exactly one of function, model, url; the rest are that kind's
    settings."""

    function: Optional[str] = opt(
        None,
        "a reward function: 'file.py:name' or 'package.module:name' (from the "
        "project directory), or a shipped one: " + ", ".join(BUILTIN),
    )
    model: Optional[str] = opt(
        None,
        "a reward model: an HF sequence-classification checkpoint (num_labels 1) "
        "scoring prompt + response",
        path=True,
    )
    url: Optional[str] = opt(
        None,
        "a remote reward: an HTTP endpoint; POST {completions, prompts, <columns>} as "
        "JSON, answers {\"rewards\": [...]}",
    )
    weight: float = opt(1.0, "this term's weight in the total reward")
    batch_size: int = opt(16, "model: sequences per forward pass; url: completions per request")
    max_length: int = opt(2048, "model: prompt + response tokens kept (the left is cut)")
    timeout: float = opt(
        30.0, "url: seconds a request may take, start to last byte (a trickling answer included)"
    )
    follow_redirects: bool = opt(
        False,
        "url: follow an http(s) redirect (up to 5) to wherever it points; off: a redirect is an "
        "error naming its target (an answer from another host is never taken as rewards)",
    )
    retries: int = opt(
        2, "url: further tries of a request that timed out, failed to connect or got a 5xx"
    )
    max_concurrency: int = opt(4, "url: requests in flight at once")
    on_error: Literal["fail", "zero"] = opt(
        "fail",
        "url: a request still failing after its retries stops the run (fail) or scores its completions 0 "
        "(zero), counted in reward/<name>/errors",
    )

    def check(self):
        kinds = [k for k in ("function", "model", "url") if getattr(self, k)]
        if len(kinds) != 1:
            yield (
                "function",
                (
                    f"give exactly one of function, model, url (got {', '.join(kinds) or 'none'}); "
                    "split them into terms of their own"
                ),
            )
        for key in ("batch_size", "max_length", "max_concurrency"):
            if getattr(self, key) < 1:
                yield key, f"must be >= 1, got {getattr(self, key)}"
        if self.retries < 0 or self.timeout <= 0:
            yield (
                "retries" if self.retries < 0 else "timeout",
                "must be >= 0 (retries) / > 0 (timeout)",
            )
        if self.url and not urllib.parse.urlparse(self.url).scheme.startswith("http"):
            yield "url", f"{self.url!r} is not an http(s) URL"

    def shown(self) -> str:
        return self.function or self.model or self.url


@dataclasses.dataclass(kw_only=True)
class RewardsConfig:
    terms: dict[str, Any] = opt(
        REQUIRED,
        "name -> a reward term (function / model / url, weight, ...); the "
        "total is the weighted sum, each term is logged as reward/<name>",
    )

    # a reward model's path, like every path key: against the current directory
    def __post_init__(
        self,
    ):
        for spec in self.terms.values() if isinstance(self.terms, dict) else ():
            if isinstance(spec, dict) and isinstance(spec.get("model"), str) and spec["model"]:
                spec["model"] = os.path.abspath(os.path.expanduser(spec["model"]))

    def check(self):
        if not self.terms:
            yield "terms", "no terms; add one, e.g. `accuracy: {function: math_verify}`"
        for name, spec in self.terms.items():
            errors = []
            term = build(RewardTerm, spec, {(): ("@", "")}, errors, (name,))
            for e in errors:
                yield "terms", e.removeprefix("@: ")
            if term is not None and not errors:
                try:
                    _check_term(name, term)
                except (ValueError, TypeError) as e:
                    yield "terms", f"{name}: {e}"

    def typed_terms(self) -> dict:
        return {name: RewardTerm(**spec) for name, spec in self.terms.items()}


def _check_term(name: str, term: RewardTerm) -> None:
    """What can be checked before anything starts: the function imports and takes `completions`;
    the reward model's directory exists; the URL's host answers a connection."""
    if term.function:
        reward_function(term.function)
    elif term.model:
        if not os.path.isfile(os.path.join(term.model, "config.json")):
            raise ValueError(
                f"model: {term.model} has no config.json; give an HF checkpoint directory"
            )
    else:
        probe_url(term.url, min(term.timeout, 5.0))


def reward_function(spec: str):
    """The function a term names: a BUILTIN name, or 'file.py:name' / 'package.module:name'. A
    ValueError names what is wrong (not found: the file and directories searched; not a function;
    no `completions` parameter)."""
    if ":" not in spec:
        if spec not in BUILTIN:
            close = did_you_mean(spec, BUILTIN)
            raise ValueError(
                f"function: {spec!r} is not a shipped reward ({', '.join(BUILTIN)})"
                + (f"; did you mean {close!r}?" if close else "")
                + "; for your own give 'file.py:name' or 'package.module:name'"
            )
        return BUILTIN[spec]
    fn = import_object(spec, "reward function")
    if inspect.isclass(fn) or not callable(fn):
        raise ValueError(
            f"function: {spec!r} is a {type(fn).__name__}, not a function; a reward function is "
            "f(completions, **columns) -> list[float] (a chatgen.Module class goes in model_class)"
        )
    try:
        inspect.signature(fn).bind_partial(completions=[])
    except TypeError:
        raise ValueError(
            f"function: {spec!r} has the signature {inspect.signature(fn)}; a reward function takes "
            "`completions` (and the data columns as keywords, **kwargs for the rest): "
            "def f(completions, **kwargs) -> list[float]"
        ) from None
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return fn


def probe_url(url: str, timeout: float) -> None:
    """Refuse a URL whose host does not accept a TCP connection (ValueError naming it)."""
    parts = urllib.parse.urlparse(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise ValueError(
            f"url: {url} is unreachable ({e}); start the reward service first, or fix the URL"
        ) from None


class FunctionTerm:
    def __init__(self, name: str, term: RewardTerm):
        self.fn, self.spec = reward_function(term.function), term.function

    def __call__(self, texts: list, columns: dict) -> list:
        try:
            return self.fn(completions=texts, **columns)
        except TypeError as e:
            try:
                inspect.signature(self.fn).bind(completions=texts, **columns)
            except (
                TypeError
            ):  # the call did not fit the signature, not an error inside the function
                raise TypeError(
                    f"reward function {self.spec} cannot take the data: {e}; it gets completions and "
                    f"the columns {', '.join(columns)} as keywords (add **kwargs)"
                ) from None
            except ValueError:
                pass
            raise


class ModelTerm:
    """An HF sequence-classification checkpoint scoring `prompt + response` (the record's chat
    messages through the checkpoint's chat template when it has one), in batches of batch_size,
    right-padded; the score is the model's single logit at the last token."""

    def __init__(self, name: str, term: RewardTerm):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(term.model)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            term.model, torch_dtype=torch.float32
        ).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward {name}: {term.model} has num_labels {self.model.config.num_labels}; a reward "
                "model gives one score (num_labels 1)"
            )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.model.config.pad_token_id is None:  # HF finds each row's last token through it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        self.batch_size, self.max_length = term.batch_size, term.max_length

    def texts(self, texts: list, prompts: list) -> list:
        out = []
        for prompt, response in zip(prompts, texts):
            if isinstance(prompt, list) and self.tokenizer.chat_template:  # chat messages
                out.append(
                    self.tokenizer.apply_chat_template(
                        [*prompt, {"role": "assistant", "content": response}], tokenize=False
                    )
                )
            else:
                out.append(f"{prompt if isinstance(prompt, str) else ''}{response}")
        return out

    @torch.no_grad()
    def __call__(self, texts: list, columns: dict) -> list:
        full = self.texts(texts, columns.get("prompts") or [""] * len(texts))
        scores = []
        for start in range(0, len(full), self.batch_size):
            enc = self.tokenizer(
                full[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
            )
            scores += self.model(**enc).logits[:, 0].float().tolist()  # (B,)
        return scores


class RemoteTerm:
    """POST chunks of batch_size completions to `url` ({"completions": [...], "prompts": [...],
    <column>: [...]}, JSON), max_concurrency at a time; each answers {"rewards": [...]}. A
    request that times out (`timeout`: wall-clock seconds for the whole answer), cannot connect
    or gets a 5xx is tried again (retries, backoff 0.5 s, 1 s, ...); a 4xx or a redirect is not.
    One still failing: on_error fail stops the run naming the URL and the error; zero scores its
    completions 0 and counts them. The requests run on daemon threads: one stuck in a read never
    holds the process's exit."""

    def __init__(self, name: str, term: RewardTerm):
        self.name, self.term, self.errors = name, term, 0
        self.jobs = queue.SimpleQueue()
        for i in range(term.max_concurrency):
            threading.Thread(target=self._work, name=f"reward-{name}-{i}", daemon=True).start()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, body, n = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._post(body, n))
                except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                    future.set_exception(e)

    def _submit(self, body: dict, n: int) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self.jobs.put((future, body, n))
        return future

    def _post(self, body: dict, n: int) -> list:
        data = json.dumps(body, default=_plain).encode()
        last = None
        for attempt in range(self.term.retries + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            try:
                answer = post_json(
                    self.term.url, data, self.term.timeout, self.term.follow_redirects
                )
                rewards = json.loads(answer)["rewards"]
                if not isinstance(rewards, list) or len(rewards) != n:
                    raise ValueError(f"answered {rewards!r:.200}, not {n} rewards")
                return rewards
            except HTTPStatusError as e:
                last = str(e)
                if e.status < 500:
                    break
            except RedirectRefused as e:  # never tried again
                last = f"{type(e).__name__}: {e}"
                break
            except ValueError as e:  # an answer too long, or not JSON
                last = f"{type(e).__name__}: {e}"
            except (OSError, KeyError, TypeError) as e:  # timeout, refused, reset, no "rewards"
                last = f"{type(e).__name__}: {e}"
        raise ConnectionError(
            f"reward {self.name}: {self.term.url} failed after {self.term.retries + 1} tries "
            f"({last})"
        )

    def __call__(self, texts: list, columns: dict) -> list:
        b = self.term.batch_size
        chunks = [(s, min(s + b, len(texts))) for s in range(0, len(texts), b)]
        futures = [
            self._submit(
                {"completions": texts[s:e], **{k: v[s:e] for k, v in columns.items()}},
                e - s,
            )
            for s, e in chunks
        ]
        scores = []
        for (s, e), future in zip(chunks, futures):
            try:
                scores += future.result()
            except ConnectionError as err:
                if self.term.on_error == "fail":
                    raise ConnectionError(
                        f"{err}; the run stops (on_error: fail); set on_error: zero to score "
                        "such completions 0 and go on"
                    ) from None
                self.errors += e - s
                scores += [0.0] * (e - s)
        return scores

    def close(self) -> None:
        for _ in range(self.term.max_concurrency):
            self.jobs.put(None)


def _plain(value):
    """A column value JSON cannot write as it is (a numpy number or array from a parquet file) as
    plain data."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def make_term(name: str, term: RewardTerm):
    return (FunctionTerm if term.function else ModelTerm if term.model else RemoteTerm)(name, term)


class Rewards(Module):
    """The weighted sum of the configured terms (see the module docstring); `score` also gives
    each term's rewards, which the run logs as reward/<name> (eval/reward/<name> on the held-out
    set)."""

    config_class = RewardsConfig

    def setup(self) -> None:
        self.specs = self.config.typed_terms()
        self.terms = {name: make_term(name, term) for name, term in self.specs.items()}

    def score(self, data: dict) -> dict:
        """data: {"texts": S responses, plus each record field as a list of length S}. Returns
        {"rewards": (S,) weighted total, "terms": {name: (S,)}, "weights": {name: weight},
        "metrics": {"<name>/errors": n} for remote terms}."""
        texts = data["texts"]
        columns = {k: v for k, v in data.items() if k != "texts"}
        prompts = columns.get("prompt", columns.get("messages"))
        # TRL's name: the prompt, or the chat messages
        if "prompts" not in columns and prompts is not None:
            columns["prompts"] = prompts
        terms, metrics = {}, {}
        for name, term in self.terms.items():
            before = getattr(term, "errors", 0)
            terms[name] = checked_rewards(
                term(texts, columns), texts, f"reward {name!r} ({self.specs[name].shown()})"
            )
            if isinstance(term, RemoteTerm):
                metrics[f"{name}/errors"] = term.errors - before
        weights = {name: self.specs[name].weight for name in terms}
        total = sum(weights[name] * value for name, value in terms.items())
        return {"rewards": total, "terms": terms, "weights": weights, "metrics": metrics}

    def shutdown(self) -> None:
        for term in getattr(self, "terms", {}).values():
            getattr(term, "close", lambda: None)()


def function_reward_config(path: str) -> dict:
    """The `Rewards` config that runs the plain function `path` (a model_class naming a function)
    as its one term, named after the function."""
    name = path.rpartition(":")[2]
    return {"terms": {name: {"function": path}}}


@dataclasses.dataclass(kw_only=True)
class RuleRewardConfig:
    rule: Literal[tuple(REWARDS)] = opt(
        "sort_digits", "which rule of chatgen.tasks.REWARDS scores the responses"
    )


class RuleReward(Module):
    """A shipped rule of chatgen.tasks (the configs of the tiny task use it): `Rewards` with
    `function: sort_digits` does the same."""

    config_class = RuleRewardConfig

    def setup(self) -> None:
        self.rule = REWARDS[self.config.rule]

    def score(self, data: dict) -> torch.Tensor:
        """Score S responses. Called by the run once per episode (and per evaluation).

        data: {"texts": list[str] (S response texts), plus every field of the prompt records as
        lists of length S, e.g. "prompt": list[str], "answer": list[str]}. Returns (S,) float32
        rewards.
        """
        if "answer" not in data:
            raise KeyError(
                "RuleReward needs an \"answer\" field in every prompt record of the JSONL data"
            )
        return torch.tensor(
            [
                self.rule(response, answer)
                for response, answer in zip(data["texts"], data["answer"])
            ],
            dtype=torch.float32,
        )
