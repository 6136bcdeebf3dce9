"""The decoded-size amplification attack of issue 43 item 6 against a fresh `vlmrt serve` (a subprocess on a free
loopback port): one request with a 14.5 KB PNG of 10900 x 10900 (1-bit, zlib), then one with eight of them; prints
each request's status and time and the server's peak RSS (VmHWM) after it. docs/server.md, "Decoded pixels".

    python -m benchmarks.decode_attack BUNDLE [serve options, e.g. --max-images 8]
"""
import base64, http.client, json, os, socket, struct, subprocess, sys, time, zlib

def png(w, h):
    def chunk(t, d): return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    row = b"\0" + b"\0" * ((w + 7) // 8)
    z = zlib.compressobj(9)
    data = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)) + chunk(b"IDAT", data) + chunk(b"IEND", b"")

def rss(pid, key):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key): return int(line.split()[1]) / 1024

bundle, extra = sys.argv[1], sys.argv[2:]
img = png(10900, 10900)
print(f"image: {len(img)} bytes, 10900x10900 1-bit PNG")
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
p = subprocess.Popen([sys.executable, "-m", "vlmrt.cli", "serve", bundle, "--port", str(port), "--log-level", "warning", *extra],
                     stderr=subprocess.DEVNULL)
try:
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5); c.request("GET", "/health")
            if c.getresponse().status == 200: break
        except OSError: pass
        time.sleep(0.1)
    print(f"server ready: VmRSS {rss(p.pid, 'VmRSS'):.0f} MB, VmHWM {rss(p.pid, 'VmHWM'):.0f} MB")
    uri = "data:image/png;base64," + base64.b64encode(img).decode()
    for n in (1, 8):
        body = json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}] * n
                                         + [{"type": "text", "text": "hi"}]}], "max_tokens": 2}).encode()
        t = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse(); out = r.read()
        print(f"{n} image(s), body {len(body)} bytes: HTTP {r.status} in {time.perf_counter() - t:.2f} s; "
              f"server VmHWM {rss(p.pid, 'VmHWM'):.0f} MB, VmRSS {rss(p.pid, 'VmRSS'):.0f} MB; {out[:160]!r}")
finally:
    p.terminate(); p.wait()
