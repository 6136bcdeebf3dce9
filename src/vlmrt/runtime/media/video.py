"""Video input as the checkpoint's video processor reads it (SmolVLM2, Gemma 4): decode, sample frames, tile each
frame, and the frames' prompt text, by the manifest's named ops (VideoSpec.sampling, .frames).

    clip = read_video("clip.gif")                      # or a folder of numbered frames (fps=...), an mp4 / webm (PyAV)
    idx = sample_indices(clip, spec)                   # SmolVLMVideoProcessor.sample_frames, or transformers' default
    frames = clip.frames(idx)                          # PIL RGB images
    tiles = frame_tiles(frames[0], spec, image_spec)   # resized as the video processor does (one tile per frame)
    pieces = video_pieces(spec, clip, idx)             # the intro, a timestamp line per frame, None per frame

A clip is a sequence of frames at a constant rate (`fps`, `total_frames`, `duration`), as a video decoder reports it.
An animated GIF / WebP shows each frame for its own duration: its rate is frames / total duration (FFmpeg's average
rate) and frame i of the clip is the image shown at time i / fps, so uneven durations give the right timestamps
(with even durations that is frame i itself). Durations of 0 or 10 ms or less are shown as 100 ms, as browsers do.

Sources: a path or a PIL image sequence for GIF / WebP (Pillow), a folder of numbered frames (fps given), or a video
file through PyAV (the optional extra vlmrt[video]); bytes of a GIF / WebP / video file (data URIs, http(s)) too.

FFmpeg only ever sees bytes vlmrt has read into memory, and only those of the containers in PYAV_FORMATS: the
container is named from the file's first bytes (container_format) and opened with that demuxer alone (no format
probing: FFmpeg's SDP, HLS, concat or image2 demuxers, which open sockets and other files, are never reached), and
any file the container would open besides the one it was given (io_open) is refused. Every container is closed on
every path (with), and each decoding pass stops at MAX_DECODE_S seconds and MAX_SOURCE_FRAMES frames.
"""

from __future__ import annotations

import io
import re
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...format.manifest import ImageSpec, VideoSpec
from . import aa_resize
from . import image as img_ops
from .sources import read_file, shown

MAX_VIDEO_BYTES = 1024 * 1024 * 1024  # 1 GiB on disk
MAX_FRAME_PIXELS = 40_000_000  # one frame's width × height (an 8K frame is 33 MP)
MAX_SOURCE_FRAMES = 100_000  # frames a clip may have (a 1 h video at 25 fps is 90,000)
FRAME_FILES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")
PILLOW_VIDEO = ("GIF", "WEBP", "PNG")  # animated formats Pillow decodes (APNG)
MAX_DECODE_S = 120.0  # one decoding pass of a video file through PyAV (reading its frame count, or its frames)
# the containers read through PyAV: FFmpeg demuxer -> what it is called in messages
PYAV_FORMATS = {"mov": "MP4 / MOV", "matroska": "WebM / MKV", "avi": "AVI"}
MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot")  # the first box of an MP4 / QuickTime file
VIDEO_FORMATS_SAID = ", ".join(PYAV_FORMATS.values()) + "; GIF, WebP and PNG animations"


class VideoError(ValueError):
    pass


@dataclass
class Clip:
    """A decoded video: frames at a constant rate, read on demand (frames(indices))."""

    label: str
    total_frames: int
    fps: float
    duration: float  # seconds
    _read: Callable[[np.ndarray], list]  # sorted unique indices -> PIL RGB images
    data: bytes | None = field(default=None, repr=False)  # the file's bytes it was read from (None: frames given)

    def frames(self, indices: np.ndarray) -> list:
        return self._read(np.asarray(indices))

    def __reduce__(self):
        """A clip read from a file's bytes pickles as them and is read from them again where it is unpickled (a Ray
        Serve replica, serve/ray_app.py): its decoder's state does not cross processes."""
        if self.data is None:
            raise TypeError(f"video {self.label}: a clip of frames in memory does not pickle (only one read from bytes)")
        return read_video, (None, None, self.data, self.label)


def smolvlm_indices(clip: Clip, spec: VideoSpec, max_frames: int | None = None) -> np.ndarray:
    """transformers' SmolVLMVideoProcessor.sample_frames: round(fps × duration) frames, at most max_frames, uniformly
    between the first and last frame, or between skip_secs from each end when the clip is long enough."""
    num_frames = spec.max_frames if max_frames is None else max_frames
    fps, total = spec.fps, clip.total_frames
    desired = max(1, min(int(round(fps * clip.duration)), num_frames))
    start, end = 0, total - 1
    if spec.skip_secs > 0 and (clip.duration - 2 * spec.skip_secs) > (num_frames * fps):
        start, end = int(spec.skip_secs * clip.fps), int(total - spec.skip_secs * clip.fps)
    start, end = max(0, start), min(end, total - 1)
    if start >= end:
        start, end = 0, total - 1
    return np.unique(np.linspace(start, end, desired, dtype=int))


def uniform_indices(clip: Clip, spec: VideoSpec, max_frames: int | None = None) -> np.ndarray:
    """transformers' default_sample_indices_fn (BaseVideoProcessor.sample_frames, Gemma4VideoProcessor's): n frames
    at arange(n) × total // n, n the processor's num_frames (spec.max_frames), or max(1, int(total / rate × fps))
    when it samples by fps (spec.fps); at most max_frames (--max-frames) and at most the clip's frames (transformers
    refuses a count over them; vlmrt takes every frame: the processor's answer with num_frames = the frame count)."""
    total = clip.total_frames
    cap = spec.max_frames if max_frames is None else max_frames
    n = min(max(1, int(total / clip.fps * spec.fps)) if spec.fps else cap, cap, total)
    return np.arange(n, dtype=np.int64) * total // n


# VideoSpec.sampling -> (clip, spec, max_frames) -> the sampled frames' indices, ascending
SAMPLING = {"smolvlm": smolvlm_indices, "uniform": uniform_indices}


def sample_indices(clip: Clip, spec: VideoSpec, max_frames: int | None = None) -> np.ndarray:
    """The frames the bundle's video processor samples (its named op, VideoSpec.sampling)."""
    if spec.sampling not in SAMPLING:
        raise VideoError(f"this vlmrt has no video sampling op {spec.sampling!r}; upgrade vlmrt")
    return SAMPLING[spec.sampling](clip, spec, max_frames)


def timestamps(clip: Clip, indices: np.ndarray) -> list[float]:
    return [int(i) / clip.fps for i in indices]


ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """English cardinal words as num2words writes them ("sixty-four", "one hundred and one"), 0 <= n < 10**6."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")
    if n < 1000:
        rest = n % 100
        return ONES[n // 100] + " hundred" + (" and " + number_words(rest) if rest else "")
    if n < 10**6:
        rest = n % 1000
        sep = " and " if rest and rest < 100 else ", " if rest else ""
        return number_words(n // 1000) + " thousand" + (sep + number_words(rest) if rest else "")
    raise ValueError(f"{n} frames")


def video_pieces(spec: VideoSpec, clip: Clip, indices: np.ndarray) -> list:
    """The video's prompt text as pieces (its processor's): the intro (SmolVLM: the frame count in words and the
    duration as H:MM:SS), then per frame its line with the timestamp as MM:SS ("Frame from MM:SS:", Gemma 4's
    "MM:SS ") and None where the frame's image text goes, the separator between frames, then the outro."""
    duration = timedelta(seconds=int(clip.duration))
    pieces: list = [spec.intro.format(frame_count=number_words(len(indices)), video_duration=str(duration))]
    for k, t in enumerate(timestamps(clip, indices)):
        if k:
            pieces.append(spec.separator)
        pieces += [spec.frame_line.format(timestamp=f"{int(t // 60):02d}:{int(t % 60):02d}"), None]
    return pieces + [spec.outro]


def frame_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """SmolVLMVideoProcessor's first resize: the longest edge to longest_edge (at most 4096), the other side keeping
    the aspect, truncated, then rounded up to even."""
    edge = min(img_ops.MAX_IMAGE_SIZE, longest_edge)
    aspect = width / height
    if width >= height:
        width, height = edge, int(edge / aspect)
        height += height % 2
    else:
        height, width = edge, int(edge * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def frame_tile(im, spec: VideoSpec, image: ImageSpec) -> np.ndarray:
    """One frame -> [3, S, S] float32 as SmolVLMVideoProcessor: resized to frame_size, then to S × S (S =
    spec.frame_size, the image tile), both with torchvision's antialiased uint8 resize (runtime/media/aa_resize.py), then
    rescaled and normalized as images are."""
    x = np.asarray(im.convert("RGB"), dtype=np.uint8)
    h, w = frame_size(x.shape[0], x.shape[1], spec.longest_edge)
    x = aa_resize.resize(aa_resize.resize(x, h, w, spec.resample), spec.frame_size, spec.frame_size, spec.resample)
    return img_ops.normalize([x], image)[0]


def square_tile(im, spec: VideoSpec, image: ImageSpec) -> img_ops.Tiles:
    """SmolVLM2's frame: one square tile (frame_tile), written as a lone global tile."""
    return img_ops.Tiles(frame_tile(im, spec, image)[None], 0, 0)


def image_tiling(im, spec: VideoSpec, image: ImageSpec) -> img_ops.Tiles:
    """A frame tiled by spec.frame_image's tiling op, as an image is (Gemma 4: pooled_aspect_tensor, the video
    processor's budget and resize)."""
    if spec.frame_image is None:
        raise VideoError("the bundle's video spec names no frame_image for its image_tiling frames")
    return img_ops.preprocess(im, spec.frame_image)


# VideoSpec.frames -> (frame, spec, the bundle's ImageSpec) -> the frame's Tiles
FRAMES = {"square_tile": square_tile, "image_tiling": image_tiling}


def frame_tiles(im, spec: VideoSpec, image: ImageSpec) -> img_ops.Tiles:
    if spec.frames not in FRAMES:
        raise VideoError(f"this vlmrt has no video frame op {spec.frames!r}; upgrade vlmrt")
    return FRAMES[spec.frames](im, spec, image)


# --- sources -------------------------------------------------------------------------------------------------------
def read_video(source, fps: float | None = None, data: bytes | None = None, label: str | None = None) -> Clip:
    """A clip from a path (file or folder of frames), the file's bytes (data), or a list of PIL images (fps given).
    fps: the rate of a folder's (or a list's) frames; refused for files, whose rate is their own."""
    label = label or (shown(str(source)) if isinstance(source, (str, Path)) else "the video")
    if isinstance(source, list):
        if fps is None:
            raise VideoError(f"{label}: a list of frames needs an fps")
        return _frames_clip(label, [img_ops.to_rgb(im) for im in source], _check_fps(fps, label), lambda x: x)
    if data is None:
        path = Path(source)
        try:
            if path.is_dir():
                return _folder_clip(path, fps, label)
        except VideoError:
            raise
        except (OSError, ValueError) as e:  # a name too long, a NUL byte, no permission
            raise VideoError(f"cannot read video {label}: {getattr(e, 'strerror', None) or e}") from None
        if fps is not None:
            raise VideoError(f"{label}: --fps is for a folder of frames; a video file has its own rate")
        data = read_file(path, label, "video", MAX_VIDEO_BYTES, VideoError)
    elif fps is not None:
        raise VideoError(f"{label}: fps is for a folder of frames; a video file has its own rate")
    if not data:
        raise VideoError(f"cannot read video {label}: the file is empty")
    clip = _pillow_clip(data, label) or _pyav_clip(data, label)
    clip.data = data
    return clip


def _check_fps(fps, label: str) -> float:
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 1000:
        raise VideoError(f"{label}: fps must be a number in (0, 1000], not {fps!r}")
    return float(fps)


def _frames_clip(label: str, items: list, fps: float, load: Callable[[Any], Any]) -> Clip:
    if not items:
        raise VideoError(f"{label} has no frames")
    return Clip(label, len(items), fps, len(items) / fps, lambda idx: [load(items[int(i)]) for i in idx])


def _folder_clip(path: Path, fps: float | None, label: str) -> Clip:
    """Numbered frames: the image files of the folder in the order of the number in their names (frame_2 before
    frame_10), then by name."""
    if fps is None:
        raise VideoError(f"{label} is a folder of frames: give its frame rate (--fps, or \"fps\" in the request)")
    fps = _check_fps(fps, label)
    files = [p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FRAME_FILES]
    if not files:
        raise VideoError(f"{label}: the folder has no image files ({', '.join(FRAME_FILES)})")
    if len(files) > MAX_SOURCE_FRAMES:
        raise VideoError(f"{label} has {len(files)} frames; vlmrt reads at most {MAX_SOURCE_FRAMES}")

    def order(p: Path):
        nums = re.findall(r"\d+", p.stem)
        return (int(nums[-1]) if nums else -1, p.name)

    files.sort(key=order)
    return _frames_clip(label, files, fps, img_ops.load_image)


def _pillow_clip(data: bytes, label: str) -> Clip | None:
    """An animated GIF / WebP / PNG read by Pillow (None: not a format Pillow animates: a video file for PyAV)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            im = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        return None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
        raise VideoError(f"cannot read video {label}: {e or type(e).__name__}") from None
    if im.format not in PILLOW_VIDEO and im.format in ("JPEG", "BMP", "TIFF", "ICO", "PPM"):
        raise VideoError(f"{label} is a still {im.format} image, not a video (give it as an image)")
    if im.format not in PILLOW_VIDEO or (im.format != "GIF" and not getattr(im, "is_animated", False)):
        # a GIF of one frame is a video of one frame (as transformers reads it); a still PNG / WebP / JPEG is an image
        raise VideoError(f"{label} is a still {im.format} image, not a video (give it as an image)")
    if im.width * im.height > MAX_FRAME_PIXELS or im.width * im.height == 0:
        raise VideoError(f"video {label} has {im.width}×{im.height} frames; vlmrt reads frames of 1 to "
                         f"{MAX_FRAME_PIXELS / 1e6:.0f} million pixels")
    try:
        n = getattr(im, "n_frames", 1)
        if n > MAX_SOURCE_FRAMES:
            raise VideoError(f"{label} has {n} frames; vlmrt reads at most {MAX_SOURCE_FRAMES}")
        durations = []
        for i in range(n):
            im.seek(i)
            if im.format == "WEBP":
                im.load()  # WebP sets a frame's duration when it decodes it
            d = im.info.get("duration") or 0
            durations.append(100 if d <= 10 else int(d))
    except VideoError:
        raise
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
        raise VideoError(f"cannot read video {label}: {e or type(e).__name__}") from None
    total_ms = sum(durations)
    starts = np.cumsum([0] + durations[:-1])  # ms at which each source frame is shown

    def read(idx: np.ndarray) -> list:
        out = []
        for i in idx:
            # the source frame shown at time i / fps = i * total_ms / n ms (exact, in integers)
            j = int(np.searchsorted(starts * n, int(i) * total_ms, side="right")) - 1
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    im.seek(j)
                    im.load()
                    out.append(img_ops.to_rgb(im))
            except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as e:
                raise VideoError(f"cannot read frame {j + 1} of video {label}: {e or type(e).__name__}") from None
        return out

    return Clip(label, n, n * 1000 / total_ms, total_ms / 1000, read)


def container_format(data: bytes) -> str | None:
    """The FFmpeg demuxer of PYAV_FORMATS that data's first bytes name (None: not one of them)."""
    if len(data) >= 12 and data[4:8] in MP4_BOXES:
        return "mov"
    if data[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska, WebM
        return "matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def _no_other_files(url: str, flags: int, options: dict):
    """PyAV's io_open: a container that would open another file or URL (an MP4's data reference, say) is refused."""
    raise PermissionError(f"the container refers to another file ({url[:60]!r}); vlmrt reads only the file given")


def _open(av, data: bytes, fmt: str):
    """An input container over data, read by the demuxer fmt alone, opening nothing else (io_open refuses what
    the demuxer would open through the container; the whitelists hold for any context opened inside it)."""
    options = {"format_whitelist": fmt, "protocol_whitelist": "none"}
    return av.open(io.BytesIO(data), format=fmt, container_options=options, io_open=_no_other_files)


def _why(e: Exception) -> str:
    """An FFmpeg / OS error as its reason alone (FFmpegError's str holds an errno and the bytes' name, '<none>')."""
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def _decode(av, data: bytes, fmt: str, label: str, keep: Callable[[int, Any], bool]) -> None:
    """Decode the first video stream's frames in order, calling keep(i, frame) until it returns False; at most
    MAX_SOURCE_FRAMES frames of at most MAX_FRAME_PIXELS pixels, within MAX_DECODE_S seconds."""
    deadline = time.monotonic() + MAX_DECODE_S
    i = 0
    with _open(av, data, fmt) as c:
        for packet in c.demux(video=0):
            if time.monotonic() > deadline:
                raise VideoError(f"cannot read video {label}: not decoded within {MAX_DECODE_S:g} s")
            for frame in packet.decode():
                if i >= MAX_SOURCE_FRAMES:
                    raise VideoError(f"{label} has more than {MAX_SOURCE_FRAMES} frames; vlmrt reads at most "
                                     f"{MAX_SOURCE_FRAMES}")
                if frame.width * frame.height > MAX_FRAME_PIXELS:
                    raise VideoError(f"video {label} has {frame.width}×{frame.height} frames; vlmrt reads frames up "
                                     f"to {MAX_FRAME_PIXELS / 1e6:.0f} million pixels")
                if not keep(i, frame):
                    return
                i += 1


def _pyav_clip(data: bytes, label: str) -> Clip:
    """A video file through PyAV (FFmpeg), read as transformers' read_video_pyav: the stream's frame count and average
    rate, frames decoded in order and those sampled kept. Only the containers of PYAV_FORMATS (module docstring)."""
    fmt = container_format(data)
    if fmt is None:
        raise VideoError(f"cannot read video {label}: not a video format vlmrt reads ({VIDEO_FORMATS_SAID})")
    try:
        import av
    except ImportError:
        raise VideoError(f"{label} is not a GIF / WebP / PNG animation: reading video files (mp4, webm, ...) needs "
                         "PyAV: pip install 'vlmrt[video]'") from None
    errors = (av.error.FFmpegError, OSError, ValueError, IndexError, MemoryError)
    try:
        with _open(av, data, fmt) as container:
            streams = container.streams.video
            if not streams:
                raise VideoError(f"cannot read video {label}: it has no video stream")
            s = streams[0]
            if s.codec_context is None:  # a codec FFmpeg has no decoder for (PyAV's stream then has no width)
                raise VideoError(f"cannot read video {label}: its video codec is not one this FFmpeg decodes")
            rate = float(s.average_rate) if s.average_rate else 0.0
            total = int(s.frames)
            if total <= 0 and rate > 0 and s.duration and s.time_base:  # webm / mkv: no frame count in the header
                total = int(round(float(s.duration * s.time_base) * rate))
            width, height = s.width, s.height
        if width * height > MAX_FRAME_PIXELS:
            raise VideoError(f"video {label} has {width}×{height} frames; vlmrt reads frames up to "
                             f"{MAX_FRAME_PIXELS / 1e6:.0f} million pixels")
        if total > MAX_SOURCE_FRAMES:
            raise VideoError(f"{label} has {total} frames; vlmrt reads at most {MAX_SOURCE_FRAMES}")
        if total <= 0 or rate <= 0:
            total, rate = _count_frames(av, data, fmt, label)
    except VideoError:
        raise
    except errors as e:
        raise VideoError(f"cannot read video {label}: {_why(e)}") from None

    def read(idx: np.ndarray) -> list:
        want = {int(i) for i in idx}
        got: dict[int, Any] = {}
        last = max(want)

        def keep(i, frame) -> bool:
            if i in want:
                got[i] = frame.to_image().convert("RGB")
            return i < last

        try:
            _decode(av, data, fmt, label, keep)
        except VideoError:
            raise
        except errors as e:
            raise VideoError(f"cannot read video {label}: {_why(e)}") from None
        missing = sorted(want - got.keys())
        if missing:
            raise VideoError(f"cannot read video {label}: frame {missing[0] + 1} of {total} did not decode "
                             f"(the file is truncated or its frame count is wrong)")
        return [got[int(i)] for i in idx]

    return Clip(label, total, rate, total / rate, read)


def _count_frames(av, data: bytes, fmt: str, label: str) -> tuple[int, float]:
    """Frame count and rate by decoding the whole stream (containers that record neither)."""
    times: list[float] = []
    _decode(av, data, fmt, label, lambda i, f: f.time is None or times.append(f.time) or True)
    if len(times) < 2 or times[-1] <= times[0]:
        raise VideoError(f"cannot read video {label}: cannot read its frame rate")
    return len(times), (len(times) - 1) / (times[-1] - times[0])


_DATA_URI = re.compile(r"data:((?:video|image)/[A-Za-z0-9.+-]+)(;[^,;]*)*?;base64,(.*)", re.S)


def open_source(source, fps: float | None, limits) -> Clip:
    """A clip from a conversation's video source: a path (file or folder), an http(s) URL (fetched within limits,
    runtime/media/sources.py), a data:video/...;base64 URI, or a list of PIL images."""
    import base64
    import binascii

    from .sources import fetch_url

    if isinstance(source, Clip):  # opened already (the server opens videos before queueing a request)
        return source
    if isinstance(source, list):
        return read_video(source, fps)
    s = str(source)
    if s.startswith("data:"):
        m = _DATA_URI.fullmatch(s.strip())
        if not m:
            raise VideoError("data URI: expected data:video/<type>;base64,<data>")
        try:
            data = base64.b64decode(re.sub(r"\s+", "", m.group(3)), validate=True)
        except (binascii.Error, ValueError) as e:
            raise VideoError(f"data URI: bad base64 ({e})") from None
        return read_video(None, fps, data, "data URI")
    if re.match(r"(?i)https?://", s):
        try:
            data = fetch_url(s, limits)
        except ValueError as e:  # ImageError: the fetch's one line
            raise VideoError(str(e).replace("image", "video")) from None
        return read_video(None, fps, data, shown(s))
    if re.match(r"(?i)[a-z][a-z0-9+.-]*://", s):
        raise VideoError(f"video source {s!r}: only file paths, folders, http(s):// URLs and data URIs are supported")
    return read_video(s, fps)


def frame_key(im, spec: VideoSpec) -> tuple:
    """The image cache's key of a sampled frame: its pixels' digest and how it is resized."""
    import hashlib

    h = hashlib.sha256(f"{im.mode}{im.size}".encode())
    h.update(im.tobytes())
    how = spec.frame_image.params if spec.frame_image is not None else None
    return ("frame", h.hexdigest(), spec.frames, spec.longest_edge, spec.frame_size, spec.resample, repr(how))
