"""Images and video in chat messages, as OpenAI's and Anthropic's clients send them: OpenAI
`image_url` and `video_url` content parts (`{"url": ...}` or the URL as a string) and
Anthropic `image` blocks (`source`: base64 with a media type, or a url).

Each (an Anthropic block by way of the chat's `image_url`) becomes the chat template's part (`{"type": "image"}` or `{"type": "video"}`, as
Qwen3.5's template takes them) carrying its source (`MediaSource`: the URL and the part's
name for errors); the engine fetches and preprocesses them (AsyncEngine.media_prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deltaserve.engine.media import MediaSource
from deltaserve.http.errors import bad_request, unsupported

OPENAI_MEDIA_PARTS = {"image_url": "image", "video_url": "video"}
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's
SOURCE_KEY = "source"  # where a template part keeps its MediaSource


def json_type(value: object) -> str:
    return type(value).__name__ if value is not None else "null"


def openai_part(part: dict[str, Any], at: str) -> dict[str, Any]:
    """An `image_url` / `video_url` part as the template's part."""
    kind = part["type"]
    for key in part:
        if key not in ("type", kind):
            raise unsupported(f"{at}.{key}", f"{kind} parts carry only type and {kind}")
    value = part.get(kind)
    if isinstance(value, dict):
        for key in value:
            if key not in ("url", "detail"):
                raise unsupported(f"{at}.{kind}.{key}", f"{kind} carries url (and detail)")
        if value.get("detail", "auto") != "auto":
            raise unsupported(
                f"{at}.{kind}.detail",
                "only 'auto': images are resized to the model's pixel budget (--mm-processor-kwargs)",
            )
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise bad_request(f"{at}.{kind}.url must be a non-empty string", "messages")
    return template_part(OPENAI_MEDIA_PARTS[kind], value, f"{at}.{kind}")


def anthropic_image(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An Anthropic `image` block (base64 or url source) as the chat's `image_url` part (the
    Messages API rides the chat route)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"{at}.source must be an object", "messages")
    if source.get("type") == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise bad_request(
                f"{at}.source.media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}", "messages"
            )
        if not isinstance(data, str) or not data:
            raise bad_request(f"{at}.source.data must be a base64 string", "messages")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if source.get("type") == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise bad_request(f"{at}.source.url must be a non-empty string", "messages")
        return {"type": "image_url", "image_url": {"url": url}}
    raise unsupported(f"{at}.source.type", "image sources are base64 or url")


def template_part(kind: str, url: str, part: str) -> dict[str, Any]:
    return {"type": kind, SOURCE_KEY: MediaSource(kind, url, part)}


def media_sources(messages: Sequence[dict[str, Any]]) -> list[MediaSource]:
    """Every image and video of the messages, in the order the template places them."""
    return [
        part[SOURCE_KEY]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if SOURCE_KEY in part
    ]
