"""Nothing leaves the machine: `vlmrt serve` answering requests and then idle, a program on the API and `vlmrt run`,
all inside a network trap (tests/netless.py: new user, network and mount namespaces, so that nothing can leave;
every DNS lookup recorded by a stub on 127.0.0.1:53, every TCP / UDP packet to a non-loopback address by the TUN
device holding the default routes), make no DNS lookup and send no packet; and onnxruntime keeps no device id or
event store in the home folder. The trap's own control (a lookup and three packets) must be seen, or the test fails
as broken.

Before vlmrt turned onnxruntime's telemetry off (vlmrt/__init__.py TELEMETRY_OFF), each process looked up
mobile.events.data.microsoft.com about 9.5 s after importing onnxruntime, then every 5-8 s, and wrote
~/.cache/Microsoft/DeveloperTools/.onnxruntime/{deviceid,onnxruntime.db}: hence the processes are held up HOLD_S."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ASSETS, CASES, exported

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

HERE = Path(__file__).parent
HOLD_S = 11.0  # after the sessions load; onnxruntime's uploader first looked its host up ~9.5 s after its import
SET_BY_VLMRT = ("ORT_DISABLE_TELEMETRY", "HF_HUB_DISABLE_TELEMETRY", "RAY_USAGE_STATS_ENABLED")  # TELEMETRY_OFF


def namespaces_or_skip() -> None:
    why = None
    if shutil.which("unshare") is None:
        why = "unshare (util-linux) is not installed"
    elif not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        why = "/dev/net/tun is missing or not usable"
    else:
        p = subprocess.run(["unshare", "-r", "-n", "-m", "true"], capture_output=True, text=True)
        if p.returncode:
            why = f"this kernel refuses user + network namespaces ({p.stderr.strip()})"
    if why:
        pytest.skip(f"the network trap needs unprivileged namespaces: {why}")


def test_serve_api_and_cli_make_no_dns_lookup_and_send_nothing(tmp_path_factory):
    namespaces_or_skip()
    bundle = exported(CASES[0], tmp_path_factory).bundle
    home = tmp_path_factory.mktemp("home")
    report = home.parent / "netless-report.json"
    # this test's process imported vlmrt, which set TELEMETRY_OFF's variables: the trapped processes must set them
    # themselves, so they do not inherit them
    env = {k: v for k, v in os.environ.items() if k not in SET_BY_VLMRT and k != "XDG_CACHE_HOME"}
    env["HOME"] = str(home)
    p = subprocess.run(["unshare", "-r", "-n", "-m", sys.executable, str(HERE / "netless.py"), str(bundle),
                        str(ASSETS / "chelsea.png"), str(HOLD_S), str(report)],
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(report.read_text())
    # the trap works: it saw this process's own lookup and packets
    assert "netless-control.invalid" in r["control"]["dns"], r["control"]
    sent = {(x["proto"], x["to"], x["port"]) for x in r["control"]["packets"]}
    assert {("udp", "192.0.2.1", 9), ("tcp", "198.51.100.1", 443)} <= sent, r["control"]
    if r["ipv6"]:
        assert ("tcp", "2001:db8::1", 443) in sent, r["control"]
    # vlmrt did its work
    assert r["statuses"] == [200, 200, 200, 200], r["serve_stderr"]
    assert r["api_rc"] == 0, r["api_stderr"]
    assert r["run_rc"] == 0, r["run_stderr"]
    # and nothing else
    assert r["dns"] == [], f"DNS lookups: {r['dns']}"
    assert r["packets"] == [], f"packets sent off the machine: {r['packets']}"
    written = sorted(str(f.relative_to(home)) for f in home.rglob("*") if f.is_file())
    assert not [f for f in written if "Microsoft" in f], written
