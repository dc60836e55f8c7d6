# SPDX-License-Identifier: ISC
"""bench/opensmtpd_relay.py: a private OpenSMTPD for bench/email_bench.py.

Debian 12's `opensmtpd` package (6.8) supplies /usr/sbin/smtpd; its own
service is never used (scripts/install-deps.sh disables it).  The bench
starts `smtpd -d` as its own foreground process, in a mount namespace
(`unshare -m`) where /var/spool and /run are bind mounts of directories in
the bench's scratch dir: the queue and the control socket are private, so a
system smtpd (or the package's, if someone started it) is neither read nor
disturbed.  It listens on 127.0.0.1 on a free port (never 25) and delivers
every recipient to one maildir in the scratch dir as `nobody`: a real relay
doing real work per message (queue files written, envelope committed before
the 250, a delivery process per message).  Needs root (smtpd drops to its
own users) and a kernel that allows unshare -m.
"""
import os
import pwd
import shutil
import socket
import subprocess
import time

SMTPD = "/usr/sbin/smtpd"


def unavailable():
    """Why this relay cannot run here, or None."""
    if not os.path.exists(SMTPD):
        return "%s missing (apt-get install opensmtpd; scripts/install-deps.sh does)" % SMTPD
    if os.geteuid() != 0:
        return "smtpd needs root (it drops privileges to its own users)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) missing"
    try:
        pwd.getpwnam("opensmtpd")
        pwd.getpwnam("opensmtpq")
    except KeyError:
        return "the opensmtpd/opensmtpq users are missing (the package's postinst adds them)"
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OpenSmtpd:
    def __init__(self, work, name="opensmtpd", deliver=True):
        self.dir = os.path.join(work, name)
        spool = os.path.join(self.dir, "spool")
        run = os.path.join(self.dir, "run")
        self.maildir = os.path.join(self.dir, "maildir")
        for d in (self.dir, spool, run, self.maildir):
            os.makedirs(d, exist_ok=True)
        os.makedirs(os.path.join(spool, "smtpd"), mode=0o711, exist_ok=True)
        os.chmod(os.path.join(spool, "smtpd"), 0o711)   # smtpd insists on root 0711
        for d in (self.dir, spool, run):
            os.chmod(d, 0o755)
        nobody = pwd.getpwnam("nobody")
        os.chown(self.maildir, nobody.pw_uid, nobody.pw_gid)
        self.port = free_port()
        conf = os.path.join(self.dir, "smtpd.conf")
        with open(conf, "w") as f:
            # Every recipient, any domain, goes to one maildir as nobody
            # (a virtual catch-all: the bench's recipients are no local users).
            f.write('table vusers { "@" = "nobody" }\n'
                    'listen on 127.0.0.1 port %d\n'
                    'action "store" maildir "%s" virtual <vusers>\n'
                    'match from any for any action "store"\n' % (self.port, self.maildir))
        os.chmod(conf, 0o644)
        # smtpd looks up the name of every client (and checks it forwards
        # back) before its greeting.  Answered from /etc/hosts first, as on
        # a relay with a working resolver; through this machine's sandbox
        # resolver some lookups stalled 5 s, a stall of the bench's machine
        # and not of a relay.
        resolv = os.path.join(self.dir, "resolv.conf")
        with open(resolv, "w") as f:
            f.write("lookup file bind\nnameserver 127.0.0.1\n")
        os.chmod(resolv, 0o644)
        self.log_path = os.path.join(self.dir, "smtpd.log")
        script = ("mount --make-rprivate / && mount --bind '%s' /var/spool && "
                  "mount --bind '%s' /run && mount --bind '%s' /etc/resolv.conf && "
                  "exec %s -d %s-f '%s'" % (spool, run, resolv, SMTPD, "" if deliver else "-P mda ", conf))
        self.proc = subprocess.Popen(["unshare", "-m", "sh", "-c", script],
                                     stdout=subprocess.DEVNULL,
                                     stderr=open(self.log_path, "w"))
        deadline = time.time() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.makefile("rb").readline().startswith(b"220"):
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("opensmtpd did not start: %s" % self.log_tail())
            time.sleep(0.1)

    def log_tail(self, n=5):
        with open(self.log_path, errors="replace") as f:
            return " | ".join(f.read().splitlines()[-n:])

    def version(self):
        with open(self.log_path, errors="replace") as f:
            for line in f:
                if "OpenSMTPD" in line:
                    return line.split("OpenSMTPD", 1)[1].split()[0]
        return "?"

    def delivered(self):
        d = os.path.join(self.maildir, "new")
        return len(os.listdir(d)) if os.path.isdir(d) else 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
