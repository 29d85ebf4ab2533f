"""Weights that timm fetches from the Hugging Face hub by model name (a teacher, `model.init_from`,
`pretrained=true`), where the hub may be out of reach.

Offline, huggingface_hub retries every request with back-off, and timm asks for two files: about a minute
before the one error. `hub_or_cache()` asks the hub's host once, with a short timeout; where it does not
answer, the block runs in huggingface_hub's offline mode, so that weights in the local cache load at once
and any others fail at once, as a HubUnreachable naming the fix.
"""
from __future__ import annotations

import contextlib
import socket
from typing import Iterator, Optional
from urllib.parse import urlsplit

# seconds to wait for the hub's host to accept a connection (a tuning hook)
PROBE_TIMEOUT_S = 3.0


class HubUnreachable(OSError):
    """Weights named from the hub that the local cache lacks, with the hub out of reach."""


def unreachable_reason() -> Optional[str]:
    """Why the hub's host (huggingface_hub's endpoint, HF_ENDPOINT) takes no connection, or None if it does."""
    from huggingface_hub import constants
    url = urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as error:
        return f"{constants.ENDPOINT} cannot be reached ({getattr(error, 'strerror', None) or error})"
    return None


@contextlib.contextmanager
def hub_or_cache(downloads: bool = True) -> Iterator[None]:
    """Run a block that downloads weights from the hub (unless downloads=False: then it only runs it): as it
    is where the hub answers (or offline mode is on already); else in offline mode, where a miss in the
    local cache raises HubUnreachable at once."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled
    reason = None if not downloads or constants.HF_HUB_OFFLINE else unreachable_reason()
    if reason is None:
        yield
        return
    constants.HF_HUB_OFFLINE = True  # (huggingface_hub reads this flag before every request)
    try:
        yield
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        raise HubUnreachable(f"not in the local cache, and {reason}") from error
    finally:
        constants.HF_HUB_OFFLINE = False
