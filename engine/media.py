"""Images and video from what clients send, to a `MultimodalPrompt`: fetched (a `data:` URL,
`http(s)` with a size cap, a timeout and no redirect to a private address, `file://` under
`--allowed-local-media-path`), decoded (Pillow; video frames by PyAV), and preprocessed by
transformers' own Qwen processor classes (resize to the pixel budget, patches, grid, each
placeholder run expanded, video frames sampled and timestamped), never by our own code.

transformers' Qwen3-VL video processor resizes and normalizes through torchvision, which does
not import beside the torch this project pins; `PilVideoProcessor` gives it those two
operations (PIL's bicubic resize per frame, a torch normalize) and nothing else.

Every refusal is a `MediaError` (a ValueError) naming the part: the HTTP front answers 400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaserve.engine.media_prompt import MediaItem, MultimodalPrompt
from deltaserve.engine.vision_config import VisionConfig

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # the template's, per image
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
DEFAULT_LIMITS = {"image": 16, "video": 2}  # per prompt (vLLM's --limit-mm-per-prompt)
MAX_MEDIA_BYTES = 20 * 2**20  # a fetched or inline image or video
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
MAX_VIDEO_FRAMES = 4096  # decoded before the processor samples
PROCESSOR_KWARGS = ("min_pixels", "max_pixels", "fps", "num_frames")  # --mm-processor-kwargs


class MediaError(ValueError):
    """A medium we cannot take; the message names the part (a 400)."""


@dataclass(frozen=True, slots=True)
class MediaConfig:
    """What the operator allows (vLLM's flags): `limits` per prompt, `processor_kwargs`
    (min_pixels, max_pixels for images and frames; fps, num_frames for video), local files."""

    limits: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    allowed_local_media_path: str = ""
    max_media_bytes: int = MAX_MEDIA_BYTES
    fetch_timeout_s: float = FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        for kind, limit in self.limits.items():
            if kind not in DEFAULT_LIMITS or type(limit) is not int or limit < 0:
                raise ValueError(
                    f"limit_mm_per_prompt: {kind!r}: {limit!r}; give image and video counts >= 0"
                )
        for key in self.processor_kwargs:
            if key not in PROCESSOR_KWARGS:
                raise ValueError(
                    f"mm_processor_kwargs: {key!r} is not one of {', '.join(PROCESSOR_KWARGS)}"
                )


@dataclass(frozen=True, slots=True)
class MediaSource:
    """One image or video of a request, as the client named it; `part` names it in errors."""

    kind: str  # "image" or "video"
    url: str
    part: str


@dataclass(slots=True)
class Video:
    frames: Any  # numpy [frames, height, width, 3] uint8
    fps: float


def _private(host: str) -> bool:
    """Whether `host` resolves to a loopback, private, link-local or reserved address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return True
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if (
            address.is_private
            or address.is_loopback
            or address.is_link_local
            or address.is_reserved
        ):
            return True
    return False


class MediaFetcher:
    """Bytes of a medium's URL, within the config's bounds."""

    def __init__(self, config: MediaConfig) -> None:
        self.config = config

    async def fetch(self, url: str, part: str) -> bytes:
        if not isinstance(url, str) or not url:
            raise MediaError(f"{part}: url must be a non-empty string")
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            return self._data(url, part)
        if scheme in ("http", "https"):
            return await self._http(url, part)
        if scheme == "file":
            return self._file(url, part)
        raise MediaError(f"{part}: url scheme {scheme!r:.20} is not data, http, https or file")

    def _capped(self, data: bytes, part: str) -> bytes:
        if len(data) > self.config.max_media_bytes:
            raise MediaError(f"{part}: more than {self.config.max_media_bytes} bytes")
        return data

    def _data(self, url: str, part: str) -> bytes:
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise MediaError(f"{part}: a data URL must be base64 (data:<type>;base64,...)")
        if len(payload) > self.config.max_media_bytes * 4 // 3 + 4:
            raise MediaError(f"{part}: more than {self.config.max_media_bytes} bytes")
        try:
            return self._capped(base64.b64decode(payload, validate=True), part)
        except (binascii.Error, ValueError):
            raise MediaError(f"{part}: the data URL is not valid base64") from None

    async def _http(self, url: str, part: str) -> bytes:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.config.fetch_timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for _ in range(MAX_REDIRECTS + 1):
                    async with session.get(url, allow_redirects=False) as response:
                        if response.status in (301, 302, 303, 307, 308):
                            url = urllib.parse.urljoin(url, response.headers.get("Location", ""))
                            host = urllib.parse.urlsplit(url).hostname or ""
                            if urllib.parse.urlsplit(url).scheme not in (
                                "http",
                                "https",
                            ) or _private(host):
                                raise MediaError(
                                    f"{part}: redirected to a private or non-http address"
                                )
                            continue
                        if response.status != 200:
                            raise MediaError(f"{part}: fetching the url answered {response.status}")
                        if (response.content_length or 0) > self.config.max_media_bytes:
                            raise MediaError(
                                f"{part}: more than {self.config.max_media_bytes} bytes"
                            )
                        data = bytearray()
                        async for piece in response.content.iter_chunked(1 << 16):
                            data += piece
                            self._capped(data, part)
                        return bytes(data)
                raise MediaError(f"{part}: more than {MAX_REDIRECTS} redirects")
        except TimeoutError:
            raise MediaError(
                f"{part}: fetching the url took over {self.config.fetch_timeout_s} s"
            ) from None
        except aiohttp.ClientError as e:
            raise MediaError(f"{part}: the url could not be fetched ({type(e).__name__})") from None

    def _file(self, url: str, part: str) -> bytes:
        root = self.config.allowed_local_media_path
        if not root:
            raise MediaError(f"{part}: file:// urls need --allowed-local-media-path")
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
        if not path.is_relative_to(Path(root).resolve()) or not path.is_file():
            # never say which: an answer that tells files apart is a file-system oracle
            raise MediaError(f"{part}: not a file under the allowed local media path")
        if path.stat().st_size > self.config.max_media_bytes:
            raise MediaError(f"{part}: more than {self.config.max_media_bytes} bytes")
        return path.read_bytes()


def decode_image(data: bytes, part: str) -> Any:
    """A PIL image in RGB; MediaError for bytes Pillow cannot read as one."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise MediaError(f"{part}: not an image we can read") from None


def decode_video(data: bytes, part: str) -> Video:
    """Every frame (RGB) and the frame rate, by PyAV; MediaError for bytes it cannot decode."""
    import av
    import numpy as np

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.base_rate or 24)
            frames = []
            for frame in container.decode(stream):
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) > MAX_VIDEO_FRAMES:
                    raise MediaError(f"{part}: more than {MAX_VIDEO_FRAMES} frames")
    except (av.error.FFmpegError, IndexError, ValueError) as e:
        if isinstance(e, MediaError):
            raise
        raise MediaError(f"{part}: not a video we can decode") from None
    if not frames:
        raise MediaError(f"{part}: a video without frames")
    return Video(np.stack(frames), fps)


def pil_video_processor_class() -> type:
    """transformers' Qwen3VLVideoProcessor, its torchvision resize and normalize done by PIL and
    torch (see the module docstring); built on first use (it imports torch)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    class PilOps(TorchvisionBackend):
        def resize(self, image: torch.Tensor, size: Any, resample: Any = None, **kwargs: Any):
            # image [..., C, H, W] uint8 or float; PIL's bicubic per frame, as the image processor
            lead, (c, h, w) = image.shape[:-3], image.shape[-3:]
            flat = image.reshape(-1, c, h, w)
            out = []
            for frame in flat:
                array = frame.permute(1, 2, 0).to(torch.uint8).numpy()
                resized = Image.fromarray(array).resize((size.width, size.height), Image.BICUBIC)
                out.append(torch.from_numpy(np.asarray(resized)).permute(2, 0, 1))
            return torch.stack(out).reshape(*lead, c, size.height, size.width).to(image.dtype)

        def normalize(
            self, image: torch.Tensor, mean: Any, std: Any, inplace: bool = False, **kwargs: Any
        ):
            mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
            return (image - mean) / std

    class PilVideoProcessor(Qwen3VLVideoProcessor, PilOps):
        pass

    return PilVideoProcessor


class MediaProcessor:
    """The checkpoint's processor (transformers' Qwen3VLProcessor over its image and video
    processors, configured by the checkpoint's preprocessor files and `--mm-processor-kwargs`):
    a rendered chat prompt with the template's placeholders and the media, to token ids and
    the media's pixels. Runs off the event loop (a worker thread).

    Without a max_pixels of the operator's, images are resized to at most `max_patches`
    patches, what one step encodes (engine/planner.py), rather than refused: under the
    released checkpoints' own bound (16.7M pixels, 65,536 patches) an image of 2560 x 1440
    pixels is already more than a step of 8,192 tokens."""

    def __init__(
        self,
        model_dir: str,
        tokenizer: Any,
        vision: VisionConfig,
        config: MediaConfig,
        dtype: str,
        max_patches: int | None = None,
    ) -> None:
        from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

        kwargs = config.processor_kwargs
        size = {
            key: kwargs[name]
            for key, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels"))
            if name in kwargs
        }
        video_kwargs = {key: kwargs[key] for key in ("fps", "num_frames") if key in kwargs}
        video_kwargs["do_convert_rgb"] = False  # frames come decoded as RGB (decode_video)
        image = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        video = pil_video_processor_class().from_pretrained(model_dir, **video_kwargs)
        image_size = dict(size)
        if max_patches is not None and "max_pixels" not in kwargs:
            step_pixels = max_patches * vision.patch_size**2
            if step_pixels < image.size.longest_edge:
                image_size["longest_edge"] = step_pixels
        if image_size:
            image = Qwen2VLImageProcessorPil.from_pretrained(
                model_dir,
                size={
                    "shortest_edge": image.size.shortest_edge,
                    "longest_edge": image.size.longest_edge,
                    **image_size,
                },
            )
        if size:
            video = pil_video_processor_class().from_pretrained(
                model_dir,
                size={
                    "shortest_edge": video.size.shortest_edge,
                    "longest_edge": video.size.longest_edge,
                    **size,
                },
                **video_kwargs,
            )
        self.processor = _processor_class(Qwen3VLProcessor)(image, tokenizer, video)
        self.vision = vision
        self.config = config
        self.dtype = dtype

    def prompt(self, text: str, loaded: list[tuple[MediaSource, bytes]]) -> MultimodalPrompt:
        """Decode the fetched media and run the processor (off the event loop)."""
        images = [decode_image(data, s.part) for s, data in loaded if s.kind == "image"]
        videos = [decode_video(data, s.part) for s, data in loaded if s.kind == "video"]
        return self.process(text, images, videos)

    def check_counts(self, num_images: int, num_videos: int) -> None:
        for kind, count in (("image", num_images), ("video", num_videos)):
            limit = self.config.limits.get(kind, DEFAULT_LIMITS[kind])
            if count > limit:
                raise MediaError(
                    f"messages: {count} {kind}s in one prompt, more than the limit of {limit} "
                    f"(--limit-mm-per-prompt)"
                )

    def process(self, text: str, images: list[Any], videos: list[Video]) -> MultimodalPrompt:
        """Token ids of `text` (its placeholders expanded) and the media, in order."""
        import numpy as np
        import torch

        self.check_counts(len(images), len(videos))
        if text.count(IMAGE_PLACEHOLDER) != len(images) or text.count(VIDEO_PLACEHOLDER) != len(
            videos
        ):
            raise MediaError("messages: the chat template placed a different number of media")
        kwargs: dict[str, Any] = {}
        if videos:
            from transformers.video_utils import VideoMetadata

            kwargs["videos"] = [torch.from_numpy(v.frames).permute(0, 3, 1, 2) for v in videos]
            kwargs["videos_kwargs"] = {
                "video_metadata": [
                    VideoMetadata(total_num_frames=len(v.frames), fps=v.fps) for v in videos
                ],
                "do_sample_frames": True,
                "return_metadata": True,
                "cap_pixels_per_frame": True,
            }
        try:
            out = self.processor(text=[text], images=images or None, return_tensors="np", **kwargs)
        except ValueError as e:  # the aspect ratio over 200, too few frames
            raise MediaError(f"messages: a medium the processor refused ({e})") from None
        ids = [int(t) for t in out["input_ids"][0]]
        media = []
        vision = self.vision
        merge = vision.spatial_merge_size
        for kind, token in (("image", vision.image_token_id), ("video", vision.video_token_id)):
            grids = out.get(f"{kind}_grid_thw" if kind == "image" else "video_grid_thw")
            pixels = out.get("pixel_values" if kind == "image" else "pixel_values_videos")
            if grids is None:
                continue
            starts = _runs(ids, token)
            at = 0
            for grid in np.asarray(grids).tolist():
                t, h, w = grid
                count = t * h * w
                patch = np.ascontiguousarray(np.asarray(pixels[at : at + count], dtype=np.float32))
                at += count
                offsets, starts = tuple(starts[:t]), starts[t:]  # a video: a run per frame group
                raw = _to_dtype(patch, self.dtype)
                media.append(
                    MediaItem(
                        hashlib.sha256(raw).digest(), (t, h, w), offsets, merge, raw, self.dtype
                    )
                )
        media.sort(key=lambda item: item.first)
        return MultimodalPrompt(tuple(ids), tuple(media))


def _processor_class(base: type) -> type:
    """Qwen3VLProcessor, whose check of its video processor's class looks it up in a registry
    that needs torchvision: our `PilVideoProcessor` is one by inheritance."""

    class Processor(base):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> type:
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    return Processor


def _runs(ids: list[int], token: int) -> list[int]:
    """Where each run of `token` starts."""
    return [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]


def _to_dtype(patch: Any, dtype: str) -> bytes:
    """The processor's fp32 patches as raw bytes of the model's dtype (the tower casts to it)."""
    if dtype == "float32":
        return patch.tobytes()
    import torch

    return torch.from_numpy(patch).to(getattr(torch, dtype)).view(torch.uint8).numpy().tobytes()
