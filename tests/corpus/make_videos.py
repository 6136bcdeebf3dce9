"""Writes the video half of the bad-input corpus (tests/corpus/videos/) and its expected outcomes
(tests/corpus/videos.json). Run once and commit the output; test_bad_input_corpus.py reads the files, never this (the Matroska
muxer writes a random segment UID: rerunning changes ok.mkv and ok.webm, not what they hold).

    .venv/bin/python tests/corpus/make_videos.py

The files FFmpeg would take as something other than a video (a session description that opens UDP sockets, an HLS
playlist and a concat script that open other files and URLs) name loopback addresses and paths only: were one ever
opened, nothing would leave the machine.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "videos"
NOT_A_VIDEO = "not a video format vlmrt reads"


def encoded(fmt: str, codec: str = "mpeg4", frames: int = 12) -> bytes:
    """frames 48×32 frames at 10 fps, each a flat grey level, in the container fmt."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        s = out.add_stream(codec, rate=10)
        s.width, s.height, s.pix_fmt = 48, 32, "yuv420p"
        for i in range(frames):
            x = np.full((32, 48, 3), i * 20, np.uint8)
            for pkt in s.encode(av.VideoFrame.from_ndarray(x, format="rgb24")):
                out.mux(pkt)
        for pkt in s.encode():
            out.mux(pkt)
    return buf.getvalue()


def unknown_codec(avi: bytes) -> bytes:
    """An AVI whose video codec tag names no decoder: PyAV gives its stream no codec context."""
    return avi.replace(b"FMP4", b"QQQQ").replace(b"fmp4", b"qqqq")


SDP = ("v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=vlmrt corpus\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
       "m=video 5004 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\n")
HLS = "#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\nhttp://127.0.0.1:9/segment0.ts\n#EXT-X-ENDLIST\n"
CONCAT = "ffconcat version 1.0\nfile ok.mp4\nfile /etc/hostname\n"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    mp4 = encoded("mp4")
    cases = {
        "ok.mp4": (mp4, {"expect": "ok", "frames": 12, "note": "mpeg4 in MP4"}),
        "ok.mov": (encoded("mov"), {"expect": "ok", "frames": 12, "note": "mpeg4 in QuickTime"}),
        "ok.mkv": (encoded("matroska"), {"expect": "ok", "frames": 12, "note": "no frame count in the header: counted"}),
        "ok.webm": (encoded("webm", "libvpx"), {"expect": "ok", "frames": 12, "note": "VP8 in WebM"}),
        "ok.avi": (encoded("avi"), {"expect": "ok", "frames": 12, "note": "mpeg4 in AVI"}),
        "stream.sdp": (SDP.encode(), {"expect": NOT_A_VIDEO, "note": "FFmpeg's sdp demuxer binds UDP sockets (loopback here)"}),
        "playlist.m3u8": (HLS.encode(), {"expect": NOT_A_VIDEO, "note": "FFmpeg's hls demuxer fetches the segments"}),
        "list.ffconcat": (CONCAT.encode(), {"expect": NOT_A_VIDEO, "note": "FFmpeg's concat demuxer opens the files named"}),
        "stream.ts": (encoded("mpegts"), {"expect": NOT_A_VIDEO, "note": "MPEG-TS: a container vlmrt does not read"}),
        "truncated.mp4": (mp4[: len(mp4) // 2], {"expect": "cannot read video", "note": "the first half of ok.mp4"}),
        "header_only.mp4": (mp4[:40], {"expect": "cannot read video", "note": "the ftyp box and a few bytes"}),
        "garbage_after_ftyp.mp4": (mp4[:32] + bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8)),
                                   {"expect": "cannot read video", "note": "an MP4 signature, then noise"}),
        "ebml_only.webm": (b"\x1a\x45\xdf\xa3" + b"\x00" * 60, {"expect": "cannot read video", "note": "EBML magic alone"}),
        "riff_avi_only.avi": (b"RIFF\x00\x00\x00\x00AVI " + b"\x00" * 60, {"expect": "cannot read video",
                                                                             "note": "a RIFF AVI header alone"}),
        "unknown_codec.avi": (unknown_codec(encoded("avi")), {"expect": "is not one this FFmpeg decodes",
                                                              "note": "ok.avi with its codec tag changed (a 500 before)"}),
        "text.mp4": (b"just some text, not a video\n" * 10, {"expect": NOT_A_VIDEO, "note": ""}),
    }
    expected = {}
    for name, (data, case) in cases.items():
        (OUT / name).write_bytes(data)
        expected[name] = case
    (HERE / "videos.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
