"""The HTTP side of an engine's server: JSON requests with errors that name the URL, and the served model."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from eagle3ops.errors import InputError

REQUEST_TIMEOUT_S = 900.0


class EngineError(InputError):
    """The server cannot be reached, answers with an error, or does not report speculative decoding."""


def fetch(url: str, payload: dict | None = None) -> bytes:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.read()
    except urllib.error.HTTPError as err:
        raise EngineError(f"{url}: HTTP {err.code}: {err.read().decode('utf-8', 'replace')[:300]}") from None
    except (urllib.error.URLError, OSError) as err:  # refused, unknown host, timeout
        raise EngineError(f"{url}: cannot reach the server ({getattr(err, 'reason', err)}); check the URL configured "
                          f"(eval.server_url, train.online_url)") from None


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
    models = fetch_json(f"{url}/v1/models").get("data")
    if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise EngineError(f"{url}/v1/models: no served model listed")
    return models[0]["id"]
