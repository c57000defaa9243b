"""The HTTP side of an engine's server: every request to it, with retries and errors that name the URL, and the
served model. The eval backends, the vLLM capture and online training send with `fetch` / `fetch_json`; the
`openai` generation backend with `send_async` from its own concurrent client.

Retries. 408, 429, 5xx, timeouts and connection errors are retried up to `max_retries` times, after
`backoff_s * 2**attempt` (capped, times a random 0.5-1 so that many clients do not retry in step), or after the
server's Retry-After when it asks for longer. Any other 4xx fails at once with the server's own message: a
wrong model name or a prompt over the context limit does not get better by asking again. Every request sent this
way gives the same result when sent twice: model lists and metrics are reads, a completion is taken from the
answer that came back (a generated turn carries its own seed). An attempt cut off midway may still have run on the
server: its verification steps count in vLLM's spec-decode counters, and the wait in the eval's time of its set.
"""
from __future__ import annotations

import asyncio
import email.utils
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx2

from eagle3ops.errors import InputError

REQUEST_TIMEOUT_S = 900.0
MAX_RETRIES = 6
BACKOFF_S = 1.0  # the first retry's delay; doubles with each attempt
BACKOFF_CAP_S = 60.0
ENGINE_URLS = "eval.server_url, train.online_url"  # the settings that name the servers `fetch` is sent to


# Servers whose process this one can see (started here, or an engine session's): base URL -> a check that says why
# the server is gone, None while it runs. A failed request to one that is gone is not retried.
_GONE_CHECKS: dict[str, Callable[[], str | None]] = {}


@contextmanager
def watched(url: str, gone: Callable[[], str | None]) -> Iterator[None]:
    """Requests to `url` within the block ask `gone` before waiting for a retry."""
    _GONE_CHECKS[url] = gone
    try:
        yield
    finally:
        _GONE_CHECKS.pop(url, None)


def server_gone(url: str) -> str | None:
    """Why the watched server that `url` is sent to is gone; None where it runs or is not watched."""
    return next((why for base, check in list(_GONE_CHECKS.items()) if url.startswith(base) and (why := check())), None)


class EngineError(InputError):
    """The server refused a request (a 4xx other than 408/429), answered with something else than asked, or cannot
    be used as configured; the message carries the server's own words."""


class EngineUnavailable(EngineError):
    """Retries exhausted: the server stayed overloaded, failing or unreachable."""


def retry_after_s(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def server_message(response: httpx2.Response) -> str:
    """The error text of a response, as OpenAI/vLLM ({"error": {"message"}}), SGLang/old vLLM ({"message"})
    or FastAPI ({"detail"}) write it; else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        error = error.get("message") if isinstance(error, dict) else error
        for found in (error, body.get("message"), body.get("detail")):
            if found:
                return found if isinstance(found, str) else json.dumps(found)
    return json.dumps(body)[:500]


@dataclass
class Retries:
    """A client's retry policy (the module docstring's), and what it sent: requests (retries included), retries.
    `url_setting` names the setting that holds the server's URL, said when the server cannot be reached."""
    max_retries: int = MAX_RETRIES
    backoff_s: float = BACKOFF_S
    url_setting: str | None = None
    requests: int = 0
    retries: int = 0

    def wait_s(self, method: str, url: str, attempt: int, outcome: httpx2.Response | httpx2.TransportError
               ) -> float | None:
        """After an attempt: None when `outcome` is the answer, else how long to wait before the next one. Raises
        EngineError when asking again cannot help, EngineUnavailable when the retries are spent."""
        self.requests += 1
        if isinstance(outcome, httpx2.TransportError):  # timeouts, refused or dropped connections
            problem, asked = f"{type(outcome).__name__}: {outcome}", None
        else:
            status = outcome.status_code
            if status < 400:
                return None
            if status not in (408, 429) and status < 500:
                raise EngineError(f"{method} {url}: HTTP {status}: {server_message(outcome)}")
            problem = f"HTTP {status}: {server_message(outcome)}"
            asked = retry_after_s(outcome.headers.get("retry-after"))
        gone = server_gone(url)
        if gone:
            raise EngineUnavailable(f"{method} {url}: {problem}; {gone}")
        if attempt == self.max_retries:
            spent = f"gave up after {attempt + 1} attempts; last: {problem}"
            if isinstance(outcome, httpx2.Response):
                raise EngineUnavailable(f"{method} {url}: {spent}")
            managed = any(url.startswith(base) for base in _GONE_CHECKS)  # the stage's own server: no setting names it
            check = f"; check the URL configured ({self.url_setting})" if self.url_setting and not managed else ""
            raise EngineUnavailable(f"{method} {url}: cannot reach the server ({spent}){check}")
        delay = max(min(BACKOFF_CAP_S, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0), asked or 0.0)
        print(f"{method} {url}: {problem}; retry {attempt + 1}/{self.max_retries} in {delay:.1f}s",
              file=sys.stderr, flush=True)
        self.retries += 1
        return delay


def send(method: str, url: str, body: dict | None = None, retries: Retries | None = None) -> httpx2.Response:
    """One request (a JSON body, or none), retried as `retries` says (default: the module's settings, read here)."""
    retries = retries or Retries(MAX_RETRIES, BACKOFF_S, ENGINE_URLS)
    for attempt in itertools.count():
        try:
            outcome = httpx2.request(method, url, json=body, timeout=REQUEST_TIMEOUT_S)
        except httpx2.TransportError as err:
            outcome = err
        delay = retries.wait_s(method, url, attempt, outcome)
        if delay is None:
            return outcome
        time.sleep(delay)


async def send_async(client: httpx2.AsyncClient, method: str, path: str, body: dict | None,
                     retries: Retries) -> httpx2.Response:
    """`send` on an asynchronous client with a base URL: many requests in flight, one event loop."""
    url = f"{client.base_url}".rstrip("/") + path
    for attempt in itertools.count():
        try:
            outcome = await client.request(method, path, json=body)
        except httpx2.TransportError as err:
            outcome = err
        delay = retries.wait_s(method, url, attempt, outcome)
        if delay is None:
            return outcome
        await asyncio.sleep(delay)


def fetch(url: str, payload: dict | None = None) -> bytes:
    """GET `url`, or POST `payload` to it as JSON; the answer's body."""
    return send("GET" if payload is None else "POST", url, payload).content


def fetch_json(url: str, payload: dict | None = None) -> dict:
    body = fetch(url, payload)
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise EngineError(f"{url}: the answer is not a JSON object: {body[:200]!r}")
    return answer


def served_model(url: str) -> str:
    """The model a managed or user's server at `url` (no /v1) serves, by the_one_model's rule."""
    return the_one_model(fetch_json(f"{url}/v1/models"), f"{url}/v1")


def the_one_model(listing: object, api_root: str, setting: str | None = None, root_setting: str | None = None) -> str:
    """The one rule for the model a request names: the only one an OpenAI-compatible server lists at
    `api_root`/models (`listing`, its answer). More than one listed (a server with adapters, or several models) is
    an error that names `setting`, the key that picks one, where there is one: the first of a list is a guess. No
    model list at all names `root_setting`, the key that gave `api_root`."""
    models = listing.get("data") if isinstance(listing, dict) else None
    ids = [m["id"] for m in models if isinstance(m, dict) and "id" in m] if isinstance(models, list) else None
    if ids is None or len(ids) != len(models):
        raise EngineError(f"GET {api_root}/models: not a model list: {str(listing)[:300]!r}" +
                          (f"; is {root_setting} the API root (ending in /v1)?" if root_setting else ""))
    if len(ids) != 1:
        raise EngineError(f"{api_root}/models lists {ids or 'no models'}" +
                          (f"; set {setting} to the one serving the target" if setting else
                           ": one model a server, the target, is what eagle3ops can measure"))
    return ids[0]
