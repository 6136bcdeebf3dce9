"""A network trap for test_no_network.py, run inside new user, network and mount namespaces
(`unshare -r -n -m python tests/netless.py ...`): nothing sent from here can leave the machine, and what is tried
is recorded.

- loopback is up, and so is a TUN device `out0` that holds the default routes (IPv4, and IPv6 where the kernel has it):
  a TCP or UDP packet to any non-loopback address ends up on its file descriptor, which this process reads and
  records (destination and port), and nothing else reads;
- /etc/resolv.conf is replaced (a bind mount, seen only in this mount namespace) by `nameserver 127.0.0.1`, and
  /etc/nsswitch.conf by `hosts: files dns` (no systemd-resolved or other resolver reached over a Unix socket; an
  nscd socket folder is hidden too), so every DNS lookup reaches a stub on 127.0.0.1:53 that records the name and
  answers NXDOMAIN at once.

Then it runs what vlmrt runs for a user: `vlmrt serve` on 127.0.0.1 answering a few requests (text, an image,
streamed, /v1/models) and then idle, beside a program on the API (`vlmrt.load`, one answer), both up HOLD_S seconds
after their sessions loaded; then `vlmrt run` on the bundle with an image. Then a control: this process itself looks up a name
and sends to three non-loopback addresses (TCP and UDP, IPv4 and IPv6), which the trap must record, or the trap is
broken and the test says so. The report (JSON) goes to the path given.

    python tests/netless.py BUNDLE IMAGE HOLD_S REPORT.json
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import http.client
import json
import os
import re
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TUNSETIFF, IFF_TUN, IFF_NO_PI, IFF_UP = 0x400454CA, 0x0001, 0x1000, 0x1
SIOCGIFFLAGS, SIOCSIFFLAGS, SIOCSIFADDR, SIOCSIFNETMASK, SIOCGIFINDEX, SIOCADDRT = (
    0x8913, 0x8914, 0x8916, 0x891C, 0x8933, 0x890B)
RTF_UP, RTF_GATEWAY, MS_BIND = 0x1, 0x2, 4096
CONTROL_NAME = "netless-control.invalid"
CONTROL_TO = [("udp", "192.0.2.1", 9), ("tcp", "198.51.100.1", 443), ("tcp", "2001:db8::1", 443)]


def _ifreq_flags(s, name: bytes, set_flags: int) -> None:
    flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", name, 0)))[1]
    fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", name, flags | set_flags))


def _sockaddr_in(addr: str) -> bytes:
    return struct.pack("H2s4s8s", socket.AF_INET, b"\0\0", socket.inet_aton(addr), b"")


class Trap:
    def __init__(self):
        self.dns: list[str] = []  # names looked up, in order
        self.packets: list[dict] = []  # TCP / UDP packets routed off the machine
        self.ipv6 = False
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        _ifreq_flags(s, b"lo", IFF_UP)
        self.tun = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(self.tun, TUNSETIFF, struct.pack("16sH", b"out0", IFF_TUN | IFF_NO_PI))
        _ifreq_flags(s, b"out0", IFF_UP)
        fcntl.ioctl(s, SIOCSIFADDR, b"out0".ljust(16, b"\0") + _sockaddr_in("10.0.0.1"))
        fcntl.ioctl(s, SIOCSIFNETMASK, b"out0".ljust(16, b"\0") + _sockaddr_in("255.255.255.0"))
        # struct rtentry: the default route via 10.0.0.2, on out0's subnet
        rt = struct.pack("@L16s16s16sHhLPhPLLH", 0, _sockaddr_in("0.0.0.0"), _sockaddr_in("10.0.0.2"),
                         _sockaddr_in("0.0.0.0"), RTF_UP | RTF_GATEWAY, 0, 0, 0, 0, 0, 0, 0, 0)
        fcntl.ioctl(s, SIOCADDRT, rt)
        if Path("/proc/net/if_inet6").exists():  # an address with prefix length 0: the IPv6 default route is out0
            index = struct.unpack("16si", fcntl.ioctl(s, SIOCGIFINDEX, struct.pack("16si", b"out0", 0)))[1]
            s6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
            fcntl.ioctl(s6, SIOCSIFADDR, struct.pack("16sIi", socket.inet_pton(socket.AF_INET6, "fd00::1"), 0, index))
            self.ipv6 = True
        self._resolver()
        self.stub = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.stub.bind(("127.0.0.1", 53))
        threading.Thread(target=self._serve_dns, daemon=True).start()
        threading.Thread(target=self._read_tun, daemon=True).start()

    def _resolver(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        tmp = Path(tempfile.mkdtemp(prefix="netless-"))

        def cover(target: str, content: str | None) -> None:
            src = tmp / Path(target).name
            if content is None:
                src.mkdir()
            else:
                src.write_text(content)
            if libc.mount(str(src).encode(), target.encode(), None, MS_BIND, None) != 0:
                raise OSError(ctypes.get_errno(), f"bind mount over {target}")

        if Path("/etc/resolv.conf").exists():  # (without one, glibc asks 127.0.0.1 anyway)
            cover("/etc/resolv.conf", "nameserver 127.0.0.1\noptions attempts:1 timeout:1\n")
        if Path("/etc/nsswitch.conf").exists():
            cover("/etc/nsswitch.conf", "hosts: files dns\n")
        for nscd in ("/var/run/nscd", "/run/nscd"):
            if Path(nscd).is_dir():
                cover(nscd, None)

    def _serve_dns(self) -> None:
        while True:
            q, peer = self.stub.recvfrom(4096)
            labels, i = [], 12
            while i < len(q) and q[i]:
                labels.append(q[i + 1:i + 1 + q[i]].decode("ascii", "replace"))
                i += 1 + q[i]
            self.dns.append(".".join(labels))
            end = i + 5  # the zero label, QTYPE, QCLASS
            # the same id and question, QR + RD + RA, NXDOMAIN, no answers
            self.stub.sendto(q[:2] + b"\x81\x83" + q[4:6] + b"\0\0\0\0\0\0" + q[12:end], peer)

    def _read_tun(self) -> None:
        while True:
            select.select([self.tun], [], [])
            p = os.read(self.tun, 65536)
            v = p[0] >> 4
            if v == 4:
                proto, dst, rest = p[9], socket.inet_ntop(socket.AF_INET, p[16:20]), p[(p[0] & 15) * 4:]
            elif v == 6:  # (the kernel's own ICMPv6 -- router and neighbour solicitations -- is not TCP / UDP)
                proto, dst, rest = p[6], socket.inet_ntop(socket.AF_INET6, p[24:40]), p[40:]
            else:
                continue
            if proto in (6, 17):
                self.packets.append({"proto": "tcp" if proto == 6 else "udp", "to": dst,
                                     "port": struct.unpack("!H", rest[2:4])[0]})

    def control(self) -> None:
        """Sends what the trap must catch, from this process."""
        try:
            socket.getaddrinfo(CONTROL_NAME, 443)
        except socket.gaierror:
            pass
        for proto, addr, port in CONTROL_TO:
            if ":" in addr and not self.ipv6:
                continue
            fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.sendto(b"x", (addr, port)) if proto == "udp" else s.connect((addr, port))
            except BlockingIOError:
                pass
        time.sleep(0.5)


def request(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request(method, path, body=json.dumps(body).encode() if body else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


API = """import sys, time
import vlmrt
vlm = vlmrt.load(sys.argv[1])
print("".join(vlm.chat([{"role": "user", "content": "hi"}], max_new_tokens=4)))
time.sleep(float(sys.argv[2]))
"""


def main() -> int:
    bundle, image, hold_s, report = sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
    trap = Trap()
    out: dict = {"ipv6": trap.ipv6}
    cli = [sys.executable, "-m", "vlmrt.cli"]
    # a Python program on the API and the server, side by side, each up hold_s seconds after onnxruntime is loaded
    api = subprocess.Popen([sys.executable, "-c", API, bundle, str(hold_s)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    server = subprocess.Popen([*cli, "serve", bundle, "--port", "0", "--slots", "2", "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    statuses = out["statuses"] = []
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", server.stderr.readline()).group(1))
        for _ in range(600):  # bounded: 60 s
            try:
                if request(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        ready = time.monotonic()  # (onnxruntime was imported before the sessions loaded)
        uri = "data:image/png;base64," + base64.b64encode(Path(image).read_bytes()).decode()
        for body in ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                                {"type": "text", "text": "what?"}]}], "max_tokens": 4},
                     {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}):
            statuses.append(request(port, "POST", "/v1/chat/completions", body)[0])
        statuses.append(request(port, "GET", "/v1/models")[0])
        time.sleep(max(0.0, hold_s - (time.monotonic() - ready)))  # idle
    finally:
        server.terminate()
        out["serve_stderr"] = server.communicate(timeout=30)[1][-2000:]
        out["api_rc"], out["api_stderr"] = api.wait(timeout=60), api.stderr.read()[-2000:]
    run = subprocess.run([*cli, "run", bundle, "--image", image, "--prompt", "what is this?", "--max-new-tokens", "4"],
                         capture_output=True, text=True, timeout=120)
    out["run_rc"], out["run_stderr"] = run.returncode, run.stderr[-2000:]
    out["dns"], out["packets"] = list(trap.dns), list(trap.packets)
    trap.control()
    out["control"] = {"dns": trap.dns[len(out["dns"]):], "packets": trap.packets[len(out["packets"]):]}
    report.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
