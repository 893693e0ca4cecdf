"""Images and audio in requests, over loopback HTTP: chat content parts (image_url,
input_audio, audio_url), /generate's images and audios, and the transport rules of
omniwalk/server/media.py (data: URLs, allowed local files, size caps, named 400s).

The served models are test families (tests/families/media_family.py) whose frontend
records what each request brought it: kinds, names, bytes and the prompt."""

from __future__ import annotations

import base64
import io
import sys
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
from openai import OpenAI

from omniwalk.capabilities import Capability
from omniwalk.cli import build_parser
from omniwalk.loading import EngineArgs
from omniwalk.models import registry
from omniwalk.server.app import media_options
from omniwalk.server.media import DEFAULT_MAX_MEDIA_BYTES, MediaOptions, MediaRef, marker_kinds, media_prompt
from omniwalk.server.openai_api import _without_template_bos

sys.path.insert(0, str(Path(__file__).parents[1] / "families"))
from media_family import AUDIO_MARKER, IMAGE_FAMILY, IMAGE_MARKER, MEDIA_FAMILY, PNG_MAGIC  # noqa: E402

CHAT = "/v1/chat/completions"
MAX_BYTES = 256 * 1024          # the test servers' --max-media-bytes
PNG_A = PNG_MAGIC + b"image A"
PNG_B = PNG_MAGIC + b"image B, a little longer"


def wav(rate: int = 16000, seconds: float = 0.1, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(b"\1\0" * int(rate * seconds) * channels)
    return buffer.getvalue()


WAV_A, WAV_B = wav(seconds=0.1), wav(rate=8000, seconds=0.2)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def input_audio(data: bytes | str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data if isinstance(data, str) else b64(data),
                                                   "format": fmt}}


def audio_url(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def chat(client: httpx.Client, content, **extra) -> httpx.Response:
    return client.post(CHAT, json={"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                                   "ignore_eos": True, **extra})


def received(server, response: httpx.Response):
    assert response.status_code == 200, response.text
    return server.engine.frontend(Capability.TEXT).received[response.json()["id"]]


def assert_refused(response: httpx.Response, name: str, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and error["code"] == 400
    assert error["message"].startswith(f"{name}: "), error["message"]
    assert words in error["message"], error["message"]


# ----------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def families():
    registry.register(MEDIA_FAMILY)
    registry.register(IMAGE_FAMILY)
    yield
    registry.unregister(MEDIA_FAMILY.name)
    registry.unregister(IMAGE_FAMILY.name)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    """allowed/ (the served folder) next to outside/, with a symlink that leads out."""
    root = tmp_path_factory.mktemp("media")
    allowed, outside = root / "allowed", root / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "a.png").write_bytes(PNG_A)
    (allowed / "sub" / "b.png").write_bytes(PNG_B)
    (allowed / "clip.wav").write_bytes(WAV_A)
    (allowed / "big.png").write_bytes(PNG_MAGIC + b"\0" * MAX_BYTES)
    (outside / "secret.png").write_bytes(PNG_MAGIC + b"secret")
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "inner_link.png").symlink_to(allowed / "a.png")
    return allowed


@pytest.fixture(scope="module")
def server(families, launch_server, media_dir):
    options = MediaOptions(allowed_local_media_path=media_dir, max_media_bytes=MAX_BYTES)
    with launch_server(EngineArgs("tiny-media_reverse", max_num_seqs=16), media=options) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def image_only(families, launch_server):
    """An image-only model, served without --allowed-local-media-path."""
    with launch_server(EngineArgs("tiny-image_reverse")) as running:
        with httpx.Client(base_url=running.url, timeout=60) as client:
            yield client


# ----------------------------------------------------------------------------- chat


def test_chat_media_reach_the_frontend_in_prompt_order_with_their_names(server, http):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [text("Look: "), image(data_url(PNG_A)), text(" and hear "),
                                     input_audio(WAV_A), text(" then "), audio_url(data_url(WAV_B, "audio/wav"))]},
        {"role": "assistant", "content": "Seen."},
        {"role": "user", "content": [image(data_url(PNG_B, "image/png")), text("again?")]},
    ]
    response = http.post(CHAT, json={"messages": messages, "max_tokens": 3, "ignore_eos": True,
                                     "return_token_ids": True})
    got = received(server, response)
    assert got.names == ["messages[1].content[1]", "messages[1].content[3]", "messages[1].content[5]",
                         "messages[3].content[0]"]
    assert got.kinds == ["image", "audio", "audio", "image"]
    assert got.data == [PNG_A, WAV_A, WAV_B, PNG_B]
    assert got.sizes == [len(PNG_A), len(WAV_A), len(WAV_B), len(PNG_B)]
    # each marker where its part was, in the text the chat template rendered
    expected = server.engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": f"Look: {IMAGE_MARKER} and hear {AUDIO_MARKER} then {AUDIO_MARKER}"},
         {"role": "assistant", "content": "Seen."},
         {"role": "user", "content": f"{IMAGE_MARKER}again?"}], tokenize=False, add_generation_prompt=True)
    assert got.prompt == expected
    answer = response.json()
    assert answer["prompt_token_ids"] == server.engine.tokenizer.encode(expected)
    assert answer["usage"]["completion_tokens"] == 3


def test_text_only_chat_on_a_media_model_brings_no_media(server, http):
    response = chat(http, "Hello")
    got = received(server, response)
    assert got.names == [] and got.prompt is None   # the text path: ids, as before


def test_the_openai_client_sends_an_image_part(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": data_url(PNG_A), "detail": "low"}}]
    completion = client.chat.completions.create(model="tiny-media_reverse", max_tokens=2,
                                                messages=[{"role": "user", "content": content}],
                                                extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 2
    got = server.engine.frontend(Capability.TEXT).received[completion.id]
    assert got.names == ["messages[0].content[1]"] and got.data == [PNG_A]
    assert f"What is this?{IMAGE_MARKER}" in got.prompt

    chunks = list(client.chat.completions.create(model="tiny-media_reverse", max_tokens=2, stream=True,
                                                 messages=[{"role": "user", "content": content}],
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.engine.frontend(Capability.TEXT).received[chunks[0].id].data == [PNG_A]


def test_a_marker_typed_in_text_is_refused(http):
    response = chat(http, [text(f"fake {IMAGE_MARKER}"), image(data_url(PNG_A))])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content" and "2 media marker(s) for 1" in error["message"]
    response = chat(http, f"no media, but {AUDIO_MARKER}")
    assert response.json()["error"]["param"] == "messages[0].content"


# ----------------------------------------------------------------------------- /generate


def test_generate_prepends_markers_images_first(server, http):
    response = http.post("/generate", json={"prompt": "Describe.", "max_output_tokens": 2, "ignore_eos": True,
                                            "images": [data_url(PNG_A), data_url(PNG_B)],
                                            "audios": [data_url(WAV_A, "audio/wav")]})
    got = received(server, response)
    assert got.prompt == f"{IMAGE_MARKER}{IMAGE_MARKER}{AUDIO_MARKER}Describe."
    assert got.names == ["images[0]", "images[1]", "audios[0]"] and got.data == [PNG_A, PNG_B, WAV_A]
    assert response.json()["usage"]["prompt_tokens"] == len(server.engine.tokenizer.encode(got.prompt))


def test_generate_markers_in_the_prompt_order_the_media(server, http):
    prompt = f"hear {AUDIO_MARKER}, see {IMAGE_MARKER}, hear {AUDIO_MARKER}, see {IMAGE_MARKER}"
    response = http.post("/generate", json={"prompt": prompt, "max_output_tokens": 1,
                                            "images": [data_url(PNG_A), data_url(PNG_B)],
                                            "audios": [data_url(WAV_A, "audio/wav"), data_url(WAV_B, "audio/wav")]})
    got = received(server, response)
    assert got.prompt == prompt
    assert got.names == ["audios[0]", "images[0]", "audios[1]", "images[1]"]
    assert got.data == [WAV_A, PNG_A, WAV_B, PNG_B]


@pytest.mark.parametrize("prompt,images,param,words", [
    (f"one {IMAGE_MARKER}", 2, "prompt", "1 image marker(s)"),
    (f"{IMAGE_MARKER}{IMAGE_MARKER}", 1, "prompt", "2 image marker(s)"),
    (f"{AUDIO_MARKER} no audio given", 1, "prompt", "0 image marker(s)"),
    (None, 1, "prompt_token_ids", "cannot carry media markers"),
], ids=["too few", "too many", "other kind", "ids"])
def test_generate_marker_mismatches_are_400(http, prompt, images, param, words):
    body = {"prompt": prompt} if prompt is not None else {"prompt_token_ids": [5, 6]}
    response = http.post("/generate", json={**body, "images": [data_url(PNG_A)] * images})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_generate_without_media_is_unchanged(http):
    response = http.post("/generate", json={"prompt_token_ids": [5, 6, 7], "max_output_tokens": 3,
                                            "ignore_eos": True})
    assert response.json()["token_ids"] == [7, 6, 5]


# ----------------------------------------------------------------------------- transport


HUGE = "data:image/png;base64," + "!" * (4 * MAX_BYTES)   # not base64 at all: decoding would say so
BAD = [
    # (name, the media item as a chat part, words of the message)
    ("remote https", image("https://example.com/cat.png"), "remote media URLs are not fetched; send a data: URL"),
    ("remote http audio", audio_url("http://example.com/a.wav"), "remote media URLs are not fetched"),
    ("remote ftp", image("ftp://example.com/cat.png"), "remote media URLs are not fetched"),
    ("unknown scheme", image("blob:8a7c-11"), "unsupported URL scheme 'blob'; send a data: URL"),
    ("bad base64", image("data:image/png;base64,iVBOR@w0K"), "not valid base64"),
    ("bad base64 padding", image("data:image/png;base64,iVBORw0"), "not valid base64"),
    ("bad base64 input_audio", input_audio("UklGR#"), "not valid base64"),
    ("data url not base64", image("data:image/png,rawbytes"), "only base64 data: URLs"),
    ("data url of audio as image", image(data_url(WAV_A, "audio/wav")), "data:audio/wav URL is not image"),
    ("empty data", image("data:image/png;base64,"), "the image is empty"),
    ("empty url", image(""), "the URL is empty"),
    ("too large", image(HUGE), f"bytes; at most {MAX_BYTES} are accepted (--max-media-bytes)"),
    ("video", {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
     "video input is not supported"),
    ("frontend refuses the image", image(data_url(b"GIF89a....")), "not a PNG image"),
    ("audio claiming 1 Hz", input_audio(wav(rate=1, seconds=10_000)), "sample rate is 1 Hz"),
    ("audio with 9 channels", audio_url(data_url(wav(channels=9), "audio/wav")), "9 channels"),
]


@pytest.mark.parametrize("name,part,words", BAD, ids=[case[0] for case in BAD])
def test_bad_media_are_400_naming_the_part(http, name, part, words):
    assert_refused(chat(http, [text("hi"), image(data_url(PNG_A)), part]), "messages[0].content[2]", words)


def test_too_large_is_refused_before_decoding(http):
    response = chat(http, [image(HUGE)])
    assert_refused(response, "messages[0].content[0]", f"at most {MAX_BYTES}")
    assert "base64" not in response.json()["error"]["message"]   # it was never decoded


def test_ten_minutes_of_audio_in_a_small_flac_is_refused(http):
    flac = io.BytesIO()
    soundfile.write(flac, np.zeros(16000 * 605, np.float32), 16000, format="FLAC")
    assert len(flac.getvalue()) < MAX_BYTES
    response = chat(http, [audio_url(data_url(flac.getvalue(), "audio/flac"))])
    assert_refused(response, "messages[0].content[0]", "605.0 s long; at most 600 s")


def test_generate_names_its_items(http):
    response = http.post("/generate", json={"prompt": "x", "images": [data_url(PNG_A), "https://x/y.png"]})
    assert_refused(response, "images[1]", "remote media URLs are not fetched")
    response = http.post("/generate", json={"prompt": "x", "audios": [data_url(WAV_A, "audio/wav"), "data:,"]})
    assert_refused(response, "audios[1]", "only base64")


def test_local_files_inside_the_allowed_folder(server, http, media_dir):
    for url, data in [(f"file://{media_dir / 'a.png'}", PNG_A), (str(media_dir / "sub" / "b.png"), PNG_B),
                      ("sub/b.png", PNG_B), ("sub/../a.png", PNG_A), ("inner_link.png", PNG_A)]:
        got = received(server, chat(http, [image(url)]))
        assert got.data == [data], url
    got = received(server, http.post("/generate", json={"prompt": "x", "max_output_tokens": 1,
                                                         "audios": [f"file://{media_dir / 'clip.wav'}"]}))
    assert got.data == [WAV_A] and got.names == ["audios[0]"]


@pytest.mark.parametrize("where,words", [
    ("../outside/secret.png", "outside the allowed media directory"),
    ("sub/../../outside/secret.png", "outside the allowed media directory"),
    ("{outside}/secret.png", "outside the allowed media directory"),
    ("file://{outside}/secret.png", "outside the allowed media directory"),
    ("link.png", "outside the allowed media directory"),          # a symlink leading out
    ("/etc/passwd", "outside the allowed media directory"),
    ("missing.png", "no such file"),
    ("sub", "not a regular file"),
    ("big.png", f"at most {MAX_BYTES} are accepted"),
    ("file://otherhost/a.png", "remote media URLs are not fetched"),
], ids=["dotdot", "nested dotdot", "absolute", "file url", "symlink", "etc", "missing", "folder", "too large",
        "file url with a host"])
def test_local_files_outside_the_allowed_folder_are_refused(http, media_dir, where, words):
    url = where.format(outside=media_dir.parent / "outside")
    assert_refused(chat(http, [image(url)]), "messages[0].content[0]", words)


def test_local_paths_need_the_flag(image_only, media_dir):
    for url in [str(media_dir / "a.png"), f"file://{media_dir / 'a.png'}", "a.png"]:
        assert_refused(chat(image_only, [image(url)]), "messages[0].content[0]",
                       "local media paths are not accepted (the server was started without "
                       "--allowed-local-media-path)")


def test_a_kind_the_model_does_not_take(image_only):
    assert_refused(chat(image_only, [image(data_url(PNG_A)), text("and"), input_audio(WAV_A)]),
                   "messages[0].content[2]", "this model does not take audio input")
    response = image_only.post("/generate", json={"prompt": "x", "audios": [data_url(WAV_A, "audio/wav")]})
    assert_refused(response, "audios[0]", "this model does not take audio input")
    assert chat(image_only, [image(data_url(PNG_A))]).status_code == 200


def test_a_bad_request_among_good_ones_fails_alone(server, http):
    def good(i: int) -> httpx.Response:
        return chat(http, [text(f"request {i}"), image(data_url(PNG_A + bytes([i]))), input_audio(WAV_A)],
                    max_tokens=4)

    def bad() -> httpx.Response:
        return chat(http, [text("bad"), image(data_url(PNG_A)), input_audio(wav(rate=1, seconds=10_000))])

    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(good, i) for i in range(4)] + [pool.submit(bad)] + \
                  [pool.submit(good, i) for i in range(4, 8)]
        responses = [future.result() for future in futures]
    assert_refused(responses[4], "messages[0].content[2]", "sample rate is 1 Hz")
    goods = responses[:4] + responses[5:]
    for i, response in enumerate(goods):
        got = received(server, response)
        assert got.data == [PNG_A + bytes([i]), WAV_A]
        assert response.json()["usage"]["completion_tokens"] == 4
    server.wait_idle()


# ----------------------------------------------------------------------------- units


def test_media_prompt_and_marker_kinds():
    markers = {"image": IMAGE_MARKER, "audio": AUDIO_MARKER}
    assert marker_kinds(f"a{AUDIO_MARKER}b{IMAGE_MARKER}<|image", markers) == ["audio", "image"]
    assert marker_kinds("anything", {}) == []
    refs = {"image": [MediaRef("image", "i0", "images[0]")], "audio": [MediaRef("audio", "a0", "audios[0]")]}
    prompt, ordered = media_prompt("x", refs, markers)
    assert prompt == f"{IMAGE_MARKER}{AUDIO_MARKER}x" and [r.name for r in ordered] == ["images[0]", "audios[0]"]
    prompt, ordered = media_prompt(f"{AUDIO_MARKER}{IMAGE_MARKER}", refs, markers)
    assert [r.name for r in ordered] == ["audios[0]", "images[0]"]


def test_a_template_bos_is_not_doubled():
    class BosTokenizer:
        bos_token, bos_token_id = "<s>", 1

        def encode(self, text, add_special_tokens=True):
            return [1] if add_special_tokens else []

    assert _without_template_bos(BosTokenizer(), "<s>[INST] hi") == "[INST] hi"
    BosTokenizer.encode = lambda self, text, add_special_tokens=True: []   # a tokenizer that adds none
    assert _without_template_bos(BosTokenizer(), "<s>[INST] hi") == "<s>[INST] hi"


def test_media_flags(tmp_path):
    args = build_parser().parse_args(["serve"])
    assert args.allowed_local_media_path is None and args.max_media_bytes == DEFAULT_MAX_MEDIA_BYTES == 20 * 2**20
    options = media_options(build_parser().parse_args(
        ["serve", "--allowed-local-media-path", str(tmp_path), "--max-media-bytes", "1000"]))
    assert options.allowed_local_media_path == tmp_path.resolve() and options.max_media_bytes == 1000
    with pytest.raises(ValueError, match="not a directory"):
        media_options(build_parser().parse_args(["serve", "--allowed-local-media-path", str(tmp_path / "no")]))
    with pytest.raises(ValueError, match="max-media-bytes"):
        MediaOptions(max_media_bytes=0)
