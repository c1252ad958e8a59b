"""What a store's error means: whether trying again may help (:func:`is_transient`) and
a short cause a user can act on (:func:`describe_cause`), read from the error's text
(delta-rs, obstore and pyarrow each word them their own way); the storage seam
(``deltamq/storage.py``) names every failed request with them."""

from __future__ import annotations

import re

from deltamq.errors import DeltaMQError, cause_chain

# faults a store shows under load or at a hiccup, worth trying again (S3's own advice):
# throttling, resets, server errors; 5xx as numbers of their own (see the 403 note below)
_TRANSIENT_TEXT = (
    r"Connection reset|os error 104|Broken pipe|connection closed before|IncompleteMessage|"
    r"<Code>(?:SlowDown|InternalError|ServiceUnavailable|RequestTimeout)</Code>|SlowDown|"
    r"Service Unavailable|Internal Server Error|Bad Gateway|Gateway Timeout|"
    # delta-rs listed a log while commits landed: a local directory listing (ext4 returns
    # entries in hash order) can show a new entry without the one before it
    r"Expected contiguous commit files|"
    # a 5xx only where it is an HTTP status: never an epoch, a task id or a bucket name
    r"(?:HTTP status|status code|status:?|HTTP/1\.[01]|HTTP error|response code)\s*50[0234](?![\d.])"
)


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a transient fault of the
    store: the same request may succeed when tried again."""
    for e in cause_chain(error):
        if isinstance(e, DeltaMQError):  # deltamq's own (a StorageError is already named)
            return False
        if re.search(_TRANSIENT_TEXT, f"{type(e).__name__}: {e}", re.IGNORECASE):
            return True
    return False


_CAUSES: tuple[tuple[str, str], ...] = (
    (
        # no keys configured: the client asked the instance metadata service, which did not answer
        r"latest/api/token|latest/meta-data|computeMetadata|metadata/identity",
        "no credentials (none configured, and no instance metadata service answered)",
    ),
    (
        r"URL scheme is not allowed",
        "the client refused a plain-HTTP endpoint before sending anything (set AWS_ALLOW_HTTP=true "
        "for an http:// endpoint, as docs/storage.md says)",
    ),
    (
        r"NoSuchBucket|bucket does not exist|ContainerNotFound|container does not exist",
        "the bucket does not exist",
    ),
    (
        r"InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken|Missing.?credentials|"
        r"no credentials|NoCredentialProviders|Unable to load credentials|AuthenticationFailed|"
        r"invalid_grant|Failed to get credentials|credential",
        "no credentials, or credentials the store rejects",
    ),
    # 403 as a number of its own: a retry time such as "in 2.009354039s" holds those digits
    (
        r"AccessDenied|Access Denied|Forbidden|(?<![\d.])403(?![\d.])|AuthorizationFailure|PermissionDenied",
        "access denied",
    ),
    (
        _TRANSIENT_TEXT,
        "the store failed the request (throttled, a reset connection or a server error: a "
        "transient fault; a write may or may not have landed)",
    ),
    (
        r"Connection refused|error sending request|dns error|failed to lookup|timed out|timeout|"
        r"Couldn't connect|Could not connect|unreachable|connect error|tcp connect",
        "the endpoint cannot be reached",
    ),
    (r"No such file|NotFound|not found|does not exist", "not found"),
)


def describe_cause(error: BaseException) -> str:
    """A short, user-facing cause for a store error (what to fix)."""
    text = f"{type(error).__name__}: {error}"
    for pattern, cause in _CAUSES:
        if re.search(pattern, text, re.IGNORECASE):
            return cause
    return "the store refused the request"


def error_detail(error: BaseException) -> str:
    """The store's own words, on one line: delta-rs chains its causes over several lines
    with terminal colour codes."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    text = re.sub(r"://[^/@\s]+@", "://***@", text)  # user:password@ in an endpoint URL
    # signatures, credentials and tokens in query strings (SAS tokens, presigned URLs)
    text = re.sub(r"(?i)\b(sig|signature|x-amz-[a-z-]+|token|code|key)=[^&\s]+", r"\1=***", text)
    text = " ".join(text.split()) or type(error).__name__
    return text if len(text) <= 500 else text[:500] + " …"
