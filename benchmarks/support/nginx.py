"""nginx (Debian's), as the benchmarks run it: the load balancer in front of several proxies (the
scale soak), and a compiled proxy recording nothing in front of the stub (bench_proxy: what one
hop through a proxy costs on the machine, whatever the proxy's language)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from proxy.vllm import free_port

NGINX = """
worker_processes 1;
{user}
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {work}/nginx-body;
    proxy_temp_path {work}/nginx-proxy;
    client_max_body_size 64m;
    upstream proxies {{
        {servers}
        keepalive 512;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://proxies;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host 127.0.0.1;  # a proxy on loopback answers loopback names only
            proxy_buffering off;
            proxy_read_timeout 120s;
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""


def balancer(ports: list[int], work: Path) -> tuple[list[str], str]:
    """nginx in front of the proxies, round robin (its default); a proxy that refuses connections
    is skipped for 5 s, as a deployment's balancer does. Its command and URL."""
    port = free_port()
    servers = "\n        ".join(f"server 127.0.0.1:{p} max_fails=1 fail_timeout=5s;" for p in ports)
    user = "user root;" if os.geteuid() == 0 else ""
    (work / "nginx.conf").write_text(NGINX.format(user=user, work=work, servers=servers, port=port))
    cmd = [str(nginx_bin()), "-p", str(work), "-c", str(work / "nginx.conf"), "-g", "daemon off;"]
    return cmd, f"http://127.0.0.1:{port}"


def nginx_bin() -> str | None:
    """Debian's nginx (in /usr/sbin, which a user's PATH may lack)."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
