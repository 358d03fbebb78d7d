"""check_images: Ollama's base64 pictures are refused with a 400 naming the image unless they decode."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from supervisor.errors import SupervisorError
from supervisor.images import MAX_PIXELS, check_images, decode_image, image_mime

FORMATS = ["PNG", "JPEG", "GIF", "WEBP", "BMP"]


def picture(kind: str, size: tuple[int, int] = (8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(out, format=kind)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def refused(images: object, field: str = "messages[1].images", max_images: int = 8) -> str:
    with pytest.raises(SupervisorError) as caught:
        check_images(images, max_images, field)
    assert caught.value.status == 400
    return caught.value.message


@pytest.mark.parametrize("kind", FORMATS)
def test_each_supported_format_passes(kind: str) -> None:
    check_images([b64(picture(kind))], 8, "images")


def test_null_and_an_empty_list_are_no_images() -> None:
    check_images(None, 8, "images")
    check_images([], 8, "images")


def test_a_data_url_and_base64_over_lines_pass() -> None:
    data = b64(picture("PNG"))
    check_images([f"data:image/png;base64,{data}"], 8, "images")
    wrapped = "\n".join(data[i : i + 20] for i in range(0, len(data), 20))
    check_images([wrapped], 8, "images")


def test_the_magic_bytes_name_the_type() -> None:
    for kind, mime in zip(FORMATS, ["png", "jpeg", "gif", "webp", "bmp"], strict=True):
        assert image_mime(picture(kind)[:16]) == f"image/{mime}"
        assert decode_image(b64(picture(kind)), "images[0]")[0] == f"image/{mime}"
    assert image_mime(b"hello world") is None


@pytest.mark.parametrize("images", ["abc", {"a": 1}, 7, True])
def test_not_a_list_is_refused(images: object) -> None:
    assert refused(images).startswith("messages[1].images: must be a list")


def test_more_than_max_images_is_refused() -> None:
    image = b64(picture("PNG"))
    message = refused([image] * 3, max_images=2)
    assert message.startswith("messages[1].images: 3 images; at most 2")
    check_images([image] * 2, 2, "images")


@pytest.mark.parametrize("item", [7, None, "", ["x"], {"data": "x"}])
def test_an_item_that_is_not_a_string_is_named(item: object) -> None:
    assert refused([b64(picture("PNG")), item]).startswith("messages[1].images[1]: must be a base64")


def test_invalid_base64_is_named() -> None:
    assert refused(["!!!not base64!!!"]) == "messages[1].images[0]: is not valid base64"
    assert refused(["abc"]) == "messages[1].images[0]: is not valid base64"  # no padding


def test_a_non_base64_data_url_is_refused() -> None:
    assert "data: URL must be base64" in refused(["data:image/png,rawbytes"])


@pytest.mark.parametrize("data", [b"just some text here", b"%PDF-1.7 ...", b"\x00" * 64, b"RIFF1234WAVE"])
def test_other_kinds_of_file_are_refused_by_their_first_bytes(data: bytes) -> None:
    assert "is not a PNG, JPEG, GIF, WebP or BMP" in refused([b64(data)])


@pytest.mark.parametrize("kind", FORMATS)
def test_right_magic_but_broken_body_is_refused(kind: str) -> None:
    whole = picture(kind, (64, 64))
    message = refused([b64(whole[: len(whole) // 2])], field="images")
    assert message.startswith(f"images[0]: is not a {kind} image that decodes")


@pytest.mark.parametrize("kind", FORMATS)
def test_only_the_magic_bytes_is_refused(kind: str) -> None:
    head = picture(kind)[:12]
    assert refused([b64(head)], field="images").startswith("images[0]: is not a")


def test_a_png_announcing_more_pixels_than_allowed_is_refused_before_decoding() -> None:
    side = int(MAX_PIXELS**0.5) + 10
    # A valid PNG header (IHDR) for a huge image, and no pixel data: must not be decoded or allocated.
    whole = picture("PNG", (1, 1))
    ihdr = whole.index(b"IHDR")
    fields = struct.pack(">II", side, side) + whole[ihdr + 12 : ihdr + 17]
    chunk = b"IHDR" + fields
    forged = (
        whole[: ihdr - 4]
        + struct.pack(">I", 13)
        + chunk
        + struct.pack(">I", zlib.crc32(chunk))
        + whole[ihdr + 21 :]
    )
    message = refused([b64(forged)], field="images")
    assert message.startswith(f"images[0]: {side}x{side} pixels is more than")


def test_a_later_broken_image_is_named_by_its_index() -> None:
    good = b64(picture("JPEG"))
    message = refused([good, good, b64(b"GIF89a" + b"\x00" * 20)], field="images")
    assert message.startswith("images[2]: ")
