"""The generated API key's file (`--api-key-file`) in a folder others may write to: a link planted
there is never followed (the server once overwrote the file it pointed to with the key), a file
another user made is never reused (they could read the key from it), and a stale key file of the
server's own user is replaced by a new one, not rewritten in place. A folder reached through a link
is followed once, when the key is written: at exit the server once removed a file of the key's name
in whatever folder the link pointed to by then."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import httpx
import pytest

from rollout.serve.key_file import write_generated_key
from rollout.serve.launch import ServerProcess, free_port

pytestmark = pytest.mark.timeout(180)


def shared_folder(tmp_path):
    """A folder like /tmp: everyone may write to it, and only owners may remove what is theirs."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    return folder


def test_a_planted_link_or_a_file_of_another_user_is_refused(tmp_path):
    folder = shared_folder(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (folder / "link.key").symlink_to(victim)
    with pytest.raises(ValueError, match="link.key exists and is a symbolic link"):
        write_generated_key(folder / "link.key")
    assert victim.read_text() == "precious"
    (folder / "dir.key").mkdir()
    with pytest.raises(ValueError, match="is not a regular file of this user's"):
        write_generated_key(folder / "dir.key")
    open_folder = tmp_path / "open"  # others may swap the file once written: refused
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(ValueError, match="others could replace the key file"):
        write_generated_key(open_folder / "serve.key")
    if os.geteuid() == 0:  # only root can give a file to another user
        theirs = folder / "theirs.key"
        theirs.write_text("")
        theirs.chmod(0o666)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ValueError, match=r"is not a regular file of this user's \(owner uid 65534\)"):
            write_generated_key(theirs)
        assert theirs.read_text() == ""


def test_a_stale_key_file_of_this_user_is_replaced_not_rewritten(tmp_path):
    folder = shared_folder(tmp_path)
    stale = folder / "serve.key"
    stale.write_text("old")
    stale.chmod(0o666)
    with open(stale) as spy:  # opened by someone while it was readable to all
        key_file = write_generated_key(stale)
        assert spy.read() == "old"  # the key went to a new file
    assert stale.read_text() == key_file.key and stat.S_IMODE(stale.stat().st_mode) == 0o600
    key_file.remove()
    assert not stale.exists()


def linked_folders(tmp_path):
    """`link` -> `first`; and `second`, where the link is pointed later."""
    first, second, link = tmp_path / "first", tmp_path / "second", tmp_path / "link"
    first.mkdir(mode=0o700)
    second.mkdir(mode=0o700)
    link.symlink_to(first)
    return first, second, link


def test_the_key_file_is_removed_from_the_folder_it_was_written_in(tmp_path):
    """Written through a linked folder, then the link pointed elsewhere, where a file of the same
    name is someone's: removing the key file leaves that one, and removes the key's own."""
    first, second, link = linked_folders(tmp_path)
    key_file = write_generated_key(link / "serve.key")
    assert (first / "serve.key").read_text() == key_file.key and key_file.path == first.resolve() / "serve.key"
    link.unlink()
    link.symlink_to(second)
    (second / "serve.key").write_text("precious")
    key_file.remove()
    key_file.remove()  # at exit twice (a finally and the SIGTERM handler): the second does nothing
    assert (second / "serve.key").read_text() == "precious" and not (first / "serve.key").exists()
    replaced = write_generated_key(first / "other.key")  # a file that is no longer the one written stays
    (first / "other.key").unlink()
    (first / "other.key").write_text("someone's")
    replaced.remove()
    assert (first / "other.key").read_text() == "someone's"


@pytest.mark.slow  # a server start: 10-20 s on 2 busy cores
def test_a_server_stopped_removes_its_key_file_where_it_wrote_it(tiny_model, tmp_path):
    first, second, link = linked_folders(tmp_path)
    port = free_port()
    command = [sys.executable, "-m", "rollout.serve", "--model", tiny_model, "--port", str(port)]
    command += ["--api-key-file", str(link / "serve.key"), "--log-level", "warning"]
    environment = {k: v for k, v in os.environ.items() if k != "ROLLOUT_API_KEY"}
    server = ServerProcess(subprocess.Popen(command, env=environment), f"http://127.0.0.1:{port}")
    try:
        server._wait_until_healthy(150)
        key = (first / "serve.key").read_text()
        link.unlink()
        link.symlink_to(second)
        (second / "serve.key").write_text("precious")
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{server.url}/resume", json={}, headers=headers).status_code == 200
    finally:
        assert server.stop() == -signal.SIGTERM
    assert (second / "serve.key").read_text() == "precious"  # was removed: the file the link then named
    assert not (first / "serve.key").exists()


@pytest.mark.slow  # two server starts (one refused before the engine loads): 15-40 s on 2 busy cores
def test_the_server_refuses_a_planted_link_and_replaces_its_own_stale_file(tiny_model, tmp_path):
    folder = shared_folder(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    key_file = folder / "serve.key"
    key_file.symlink_to(victim)
    port = free_port()
    command = [sys.executable, "-m", "rollout.serve", "--model", tiny_model, "--port", str(port)]
    command += ["--api-key-file", str(key_file), "--log-level", "warning"]
    environment = {k: v for k, v in os.environ.items() if k != "ROLLOUT_API_KEY"}
    refused = subprocess.run(command, env=environment, capture_output=True, timeout=150)
    assert refused.returncode == 1 and b"exists and is a symbolic link" in refused.stderr, refused.stderr
    assert victim.read_text() == "precious" and key_file.is_symlink()
    key_file.unlink()
    key_file.write_text("stale")
    key_file.chmod(0o666)
    with open(key_file) as spy:
        process = subprocess.Popen(command, env=environment)
        server = ServerProcess(process, f"http://127.0.0.1:{port}")
        try:
            server._wait_until_healthy(150)
            key = key_file.read_text()
            assert spy.read() == "stale" and stat.S_IMODE(key_file.stat().st_mode) == 0o600
            headers = {"Authorization": f"Bearer {key}"}
            assert httpx.post(f"{server.url}/resume", json={}, headers=headers).status_code == 200
        finally:
            assert server.stop() == -signal.SIGTERM
    assert not key_file.exists()
