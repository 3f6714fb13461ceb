"""`agentenv template build` from a Dockerfile, then sandboxes from the template; and the translation rules."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import requests

from agentenv.client.template_build import DockerfileError, parse_dockerfile
from cli_util import run_cli

DOCKERFILE = """\
# a small template: files, env, workdir, user and a start command
FROM base
ARG GREETING=hello
ENV APP_HOME=/home/user/app \\
    MODE="built by cli"
WORKDIR $APP_HOME
COPY app/ ./
COPY --chown=root --chmod=600 secret.bin /opt/data/
COPY .env /opt/data/
RUN echo "$GREETING $MODE" > greeting.txt && \\
    python3 main.py > out.txt
USER root
RUN touch /opt/marker && id -un > /opt/built-as
EXPOSE 8000
CMD ["python3", "-m", "http.server", "8000"]
"""


@pytest.fixture(scope="module")
def built(server, tmp_path_factory) -> dict:
    ctx = tmp_path_factory.mktemp("ctx")
    (ctx / "app").mkdir()
    (ctx / "app" / "main.py").write_text("print('hello from main')\n")
    secret = os.urandom(5000)
    (ctx / "secret.bin").write_bytes(secret)
    (ctx / ".env").write_text("DOTFILE=kept\n")  # a dotfile source keeps its leading dot
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    name = f"cli-build-{os.getpid()}"
    p = run_cli(server, "template", "build", str(ctx), "--name", name, "--json", "--ready-cmd",
                "python3 -c 'import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:8000\")'",
                timeout=600)
    status = json.loads(p.stdout)
    return {"name": name, "status": status, "log": p.stderr.decode(), "ctx": ctx, "secret": secret}


def test_build_from_a_dockerfile_then_a_sandbox_from_it(server, sandboxes, built):
    assert built["status"]["status"] == "ready", built["log"]
    assert "EXPOSE has no effect" in built["log"]  # ignored instructions are named
    assert "[9/9] RUN touch /opt/marker" in built["log"]  # the server's build log streams to stderr
    sid = sandboxes.create("--template", built["name"])
    check = ("cd /home/user/app && cat greeting.txt out.txt && stat -c '%U %a' /opt/data/secret.bin "
             "&& sha256sum /opt/data/secret.bin && cat /opt/built-as /opt/data/.env")
    out = run_cli(server, "sandbox", "exec", "-u", "root", sid, "--", check).stdout.decode().splitlines()
    assert out[0] == "hello built by cli"              # ARG and ENV reach RUN
    assert out[1] == "hello from main"                 # COPY of a directory's contents + WORKDIR
    assert out[2] == "root 600"                        # --chown / --chmod
    assert out[3].split()[0] == hashlib.sha256(built["secret"]).hexdigest()
    assert out[4] == "root"                            # USER root for the later RUN
    assert out[5] == "DOTFILE=kept"                    # COPY .env
    # CMD is the start command, running in the template's snapshot: the server answers at once
    r = requests.get(f"{server.sandbox_url}/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"},
                     timeout=30)
    assert r.status_code == 200 and "Directory listing" in r.text


def test_an_unchanged_rebuild_is_cached_and_uploads_nothing(server, built):
    p = run_cli(server, "template", "build", str(built["ctx"]), "--name", built["name"], timeout=600)
    log = p.stderr.decode()
    assert p.stdout.decode().strip() == built["name"]
    assert "uploaded" not in log, log            # the server had the COPY files already
    assert "CACHED" in log, log


def test_a_failing_step_exits_1_with_the_reason(server, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM base\nRUN echo ok\nRUN exit 3\n")
    p = run_cli(server, "template", "build", str(tmp_path), "--name", f"cli-fail-{os.getpid()}", "--json",
                check=False, timeout=600)
    assert p.returncode == 1
    status = json.loads(p.stdout)
    assert status["status"] == "error" and status["reason"]["step"] == "2"
    assert b"failed with exit code 3" in p.stderr


def test_an_unsupported_dockerfile_is_refused_before_any_build(server, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM base AS one\nFROM base\n")
    p = run_cli(server, "template", "build", str(tmp_path), "--name", "never-built", check=False)
    assert p.returncode == 1 and b"line 2: multi-stage builds are not supported" in p.stderr
    r = requests.get(f"{server.api_url}/templates/aliases/never-built", headers={"X-API-KEY": server.api_key},
                     timeout=30)
    assert r.status_code == 404


def test_the_sdk_template_json_builds_too(server, sandboxes, tmp_path):
    from e2b import Template

    (tmp_path / "hello.txt").write_text("from the SDK definition\n")
    t = Template(file_context_path=str(tmp_path)).from_image("e2bdev/base").copy("hello.txt", "/opt/hello.txt") \
        .run_cmd("cat /opt/hello.txt > /home/user/copy.txt")  # RUN steps run as `user` (as in E2B)
    (tmp_path / "t.json").write_text(Template.to_json(t))
    name = f"cli-json-tmpl-{os.getpid()}"
    run_cli(server, "template", "build", str(tmp_path), "-f", str(tmp_path / "t.json"), "--name", name,
            timeout=600)
    sid = sandboxes.create("--template", name)
    assert run_cli(server, "sandbox", "exec", sid, "--", "cat copy.txt").stdout == b"from the SDK definition\n"


# ---------------------------------------------------------------- translation rules (no server)


def _plan(text: str, ctx: Path, **args: str) -> dict:
    return parse_dockerfile(text, ctx, args).spec


def test_translation_of_instructions(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    spec = _plan('FROM alpine:3.20\nARG V=1\nENV X=$V Y="two words"\nENV LEGACY some value\n'
                 'RUN ["echo", "a b"]\nCOPY *.txt /dst\nWORKDIR /w\nUSER user:grp\n'
                 'ENTRYPOINT ["python3", "-m"]\nCMD ["http.server"]\n', tmp_path, V="9")
    assert spec["fromImage"] == "alpine:3.20"
    assert spec["steps"][:4] == [{"type": "ENV", "args": ["V", "9"]},
                                 {"type": "ENV", "args": ["X", "9", "Y", "two words"]},
                                 {"type": "ENV", "args": ["LEGACY", "some value"]},
                                 {"type": "RUN", "args": ["echo 'a b'"]}]
    assert spec["steps"][4] == {"type": "COPY", "args": ["*.txt", "/dst", "", ""]}
    assert spec["steps"][5:] == [{"type": "WORKDIR", "args": ["/w"]}, {"type": "USER", "args": ["user"]}]
    assert spec["startCmd"] == "python3 -m http.server"


def test_translation_refuses_what_it_cannot_do(tmp_path):
    for text, message in [("RUN true\n", "RUN before FROM"),
                          ("FROM base\nCOPY --from=x /a /b\n", "--from"),
                          ("FROM base\nCOPY ../etc/passwd /x\n", "outside the build context"),
                          ("FROM base\nADD https://example.com/x /x\n", "remote sources"),
                          ("FROM base\nSHELL [\"/bin/zsh\"]\n", "SHELL is not supported"),
                          ("FROM base\nCOPY missing.txt /x\n", "does not exist"),
                          ("# nothing\n", "no FROM")]:
        with pytest.raises(DockerfileError, match=message):
            parse_dockerfile(text, tmp_path)
