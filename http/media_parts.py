"""Images and video in chat messages, as OpenAI's and Anthropic's clients send them: OpenAI
`image_url` and `video_url` content parts (`{"url": ...}` or the URL as a string) and
Anthropic `image` blocks (`source`: base64 with a media type, or a url).

The OpenAI parts are typed structs of the chat body (protocol.py); an Anthropic block becomes
the chat's `image_url` part here. Each becomes the chat template's part (`{"type": "image"}`
or `{"type": "video"}`, as Qwen3.5's template takes them) carrying its source (`MediaSource`:
the URL and the part's name for errors); the engine fetches and preprocesses them
(AsyncEngine.media_prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deltaserve.engine.media import MediaSource
from deltaserve.http.errors import bad_request, unsupported

OPENAI_MEDIA_PARTS = {"image_url": "image", "video_url": "video"}
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's
SOURCE_KEY = "source"  # where a template part keeps its MediaSource


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
