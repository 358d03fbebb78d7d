"""Ollama `images`: base64-encoded pictures, each checked to be a PNG, JPEG, GIF, WebP or BMP that decodes.

An engine handed a broken picture may answer 500 or fail the whole batch; a client gets a 400 naming the
image instead. Decoding costs CPU in proportion to the pixels, so callers on the event loop should run
`check_images` in a thread (asyncio.to_thread) when a request carries images. Whether a model takes
images at all is for supervisor/capabilities.py to say.
"""

from __future__ import annotations

import base64
import binascii
import io

from supervisor import errors
from supervisor.bodies import describe

# Pixels one image may have: 50 million holds a 48-megapixel phone photo; decoding one costs ~150 MB.
MAX_PIXELS = 50_000_000

_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)
# The one Pillow plugin allowed to read each type: no other decoder ever sees client bytes.
_PILLOW_FORMAT = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/gif": "GIF",
    "image/bmp": "BMP",
    "image/webp": "WEBP",
}


def image_mime(head: bytes) -> str | None:
    """The image type its first bytes announce, or None."""
    for magic, mime in _MAGIC:
        if head.startswith(magic):
            return mime
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def check_images(images: object, max_images: int, field: str) -> None:
    """Raise a 400 naming the image (`messages[1].images[0]: ...`) unless `images` is null or a list of at
    most `max_images` base64 strings (or data: URLs), each a PNG, JPEG, GIF, WebP or BMP of at most
    MAX_PIXELS that Pillow decodes."""
    if images is None:
        return
    if not isinstance(images, list):
        raise errors.bad_request(f"{field}: must be a list of base64-encoded images, not {describe(images)}")
    if len(images) > max_images:
        raise errors.bad_request(
            f"{field}: {len(images)} images; at most {max_images} in one request (max_images)"
        )
    for index, image in enumerate(images):
        _check_image(image, f"{field}[{index}]")


def decode_image(image: object, where: str) -> tuple[str, bytes]:
    """(mime type, bytes) of one base64 image or data: URL, by its magic bytes; or a 400 naming `where`."""
    if not isinstance(image, str) or not image:
        raise errors.bad_request(f"{where}: must be a base64-encoded image, not {describe(image)}")
    text = image
    if text.startswith("data:"):
        header, _, text = text.partition(",")
        if not header.endswith(";base64"):
            raise errors.bad_request(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
    # Base64 wrapped over lines is still base64 (Go's decoder, which Ollama uses, skips newlines).
    text = "".join(text.split())
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise errors.bad_request(f"{where}: is not valid base64") from None
    mime = image_mime(data[:16])
    if mime is None:
        raise errors.bad_request(f"{where}: is not a PNG, JPEG, GIF, WebP or BMP image (by its first bytes)")
    return mime, data


def _check_image(image: object, where: str) -> None:
    mime, data = decode_image(image, where)
    kind = _PILLOW_FORMAT[mime]
    from PIL import Image  # lazily: only requests that carry images pay for importing Pillow

    try:
        with Image.open(io.BytesIO(data), formats=[kind]) as picture:
            width, height = picture.size
            if width * height > MAX_PIXELS:
                raise errors.bad_request(
                    f"{where}: {width}x{height} pixels is more than {MAX_PIXELS:,} ({kind}); resize it"
                )
            picture.draft(picture.mode, (1, 1))  # JPEG decodes at 1/8 scale: every block, less work
            picture.load()
    except errors.SupervisorError:
        raise
    except Exception as exc:
        # Client bytes reach a decoder that fails in many ways (OSError, SyntaxError, ValueError, ...);
        # every one of them is a broken picture, so a 400, never a 500.
        reason = str(exc) or type(exc).__name__
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        raise errors.bad_request(f"{where}: is not a {kind} image that decodes: {reason}") from None
