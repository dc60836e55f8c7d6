# SPDX-License-Identifier: ISC
"""A private Postfix on loopback: Debian's postfix binaries with a config
of its own, for the email provider's tests and bench.

Debian's postfix package conflicts with opensmtpd (the bench's other
relay), so scripts/install-deps.sh unpacks the package's binaries
(apt-get download postfix; dpkg-deb -x) into /opt/outbox-postfix and
creates the users Postfix needs (postfix, group postdrop); an installed
postfix (/usr/lib/postfix/sbin/master) is used as well.  Nothing of the
machine's own mail setup is touched: config, queue and mail live in one
scratch directory, the master runs in the foreground (-d) and listens on
127.0.0.1 only, on a free port of its own.

The config is Debian's where it matters to a client: Postfix 3.7's
smtpd with its defaults (PIPELINING, CHUNKING, 8BITMIME, ENHANCEDSTATUSCODES
offered; chunking=False discards CHUNKING from EHLO, as
`smtpd_discard_ehlo_keywords = chunking` does).  Mail for example.com is
delivered by the virtual agent into one maildir, so that a test counts the
deliveries per Message-ID (.count(message_id), .deliveries()).  Limits
that would throttle a loopback bench are off (in_flow_delay, the anvil
client limits).

Needs root (the master starts as root and runs its children as postfix).
PostfixRelay(chunking=True).start() -> port; .stop(); .smtpd_pids().
available() -> None, or why this machine cannot run it.
"""
import email.parser
import email.policy
import os
import pwd
import grp
import shutil
import signal
import socket
import subprocess
import tempfile
import time

ROOTS = [os.environ.get("OUTBOX_POSTFIX_ROOT", ""), "/opt/outbox-postfix", "/"]

SERVICES = """\
{listen} inet n - n - - smtpd
cleanup unix n - n - 0 cleanup
qmgr unix n - n 300 1 qmgr
rewrite unix - - n - - trivial-rewrite
bounce unix - - n - 0 bounce
defer unix - - n - 0 bounce
trace unix - - n - 0 bounce
verify unix - - n - 1 verify
flush unix n - n 1000? 0 flush
proxymap unix - - n - - proxymap
showq unix n - n - - showq
error unix - - n - - error
retry unix - - n - - error
discard unix - - n - - discard
virtual unix - n n - - virtual
anvil unix - - n - 1 anvil
scache unix - - n - 1 scache
"""

QUEUE_DIRS = ["incoming", "active", "deferred", "bounce", "defer", "trace", "flush", "hold",
              "corrupt", "saved", "private"]


def postfix_root():
    for r in ROOTS:
        if r and os.path.exists(os.path.join(r, "usr/lib/postfix/sbin/master")):
            return r
    return None


def available():
    if os.geteuid() != 0:
        return "the Postfix master must start as root"
    if postfix_root() is None:
        return "no Postfix binaries (scripts/install-deps.sh unpacks them into /opt/outbox-postfix)"
    try:
        pwd.getpwnam("postfix")
        grp.getgrnam("postdrop")
    except KeyError:
        return "no postfix user or postdrop group (scripts/install-deps.sh creates them)"
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostfixRelay:
    def __init__(self, chunking=True, extra=None):
        self.chunking = chunking
        self.extra = extra or {}
        self.port = None
        self.proc = None
        self.dir = None

    # -- setup -----------------------------------------------------------
    def _config(self):
        root = postfix_root()
        pw = pwd.getpwnam("postfix")
        d = self.dir
        lib = os.path.join(root, "usr/lib/postfix")
        main = {
            "compatibility_level": "3.6",
            "config_directory": f"{d}/etc",
            "queue_directory": f"{d}/queue",
            "data_directory": f"{d}/data",
            "meta_directory": f"{d}/etc",
            "command_directory": os.path.join(root, "usr/sbin"),
            "daemon_directory": os.path.join(lib, "sbin"),
            "shlib_directory": lib,
            "mail_owner": "postfix",
            "setgid_group": "postdrop",
            "myhostname": "relay.outbox.test",
            "mydomain": "outbox.test",
            "mydestination": "",
            "inet_interfaces": "127.0.0.1",
            "inet_protocols": "ipv4",
            "mynetworks": "127.0.0.0/8",
            "smtpd_relay_restrictions": "permit_mynetworks, reject",
            # refused@example.com is refused at RCPT TO (550), as a relay
            # refuses an unknown user
            "smtpd_recipient_restrictions": "check_recipient_access "
                                            "inline:{ { refused@example.com = 550 5.1.1 no such user } }, "
                                            "permit_mynetworks, reject",
            "virtual_mailbox_domains": "example.com",
            "virtual_mailbox_base": f"{d}/mail",
            "virtual_mailbox_maps": "static:all/",
            "virtual_uid_maps": f"static:{pw.pw_uid}",
            "virtual_gid_maps": f"static:{pw.pw_gid}",
            "virtual_minimum_uid": "1",
            "virtual_destination_concurrency_limit": "20",
            "in_flow_delay": "0",
            "smtpd_client_connection_count_limit": "0",
            "smtpd_client_connection_rate_limit": "0",
            "smtpd_client_message_rate_limit": "0",
            "default_process_limit": "200",
            # a SIGKILLed idle smtpd (the kill tests) throttles the service
            # for 60 s by default
            "service_throttle_time": "1s",
            "biff": "no",
            "append_dot_mydomain": "no",
            "smtputf8_enable": "no",
            "alias_maps": "",
            "alias_database": "",
            "import_environment": f"MAIL_CONFIG MAIL_DEBUG MAIL_LOGTAG TZ LANG=C LD_LIBRARY_PATH={lib}",
        }
        if not self.chunking:
            main["smtpd_discard_ehlo_keywords"] = "chunking"
        main.update(self.extra)
        with open(f"{d}/etc/main.cf", "w") as f:
            f.write("".join(f"{k} = {v}\n" for k, v in main.items()))
        with open(f"{d}/etc/master.cf", "w") as f:
            f.write(SERVICES.format(listen=f"127.0.0.1:{self.port}"))
        for name in ("dynamicmaps.cf", "postfix-files"):
            src = os.path.join(root, "etc/postfix", name)
            if os.path.exists(src):
                shutil.copy(src, f"{d}/etc/{name}")
        return root, lib, pw

    def start(self, timeout=30):
        why = available()
        if why:
            raise RuntimeError(why)
        self.dir = tempfile.mkdtemp(prefix="outbox-postfix-")
        os.chmod(self.dir, 0o755)
        self.port = free_port()
        for sub in ("etc", "queue", "data", "mail"):
            os.makedirs(f"{self.dir}/{sub}")
        root, lib, pw = self._config()
        gid_pd = grp.getgrnam("postdrop").gr_gid
        q = f"{self.dir}/queue"
        os.makedirs(f"{q}/pid")
        for sub in QUEUE_DIRS:
            os.makedirs(f"{q}/{sub}", mode=0o700)
            os.chown(f"{q}/{sub}", pw.pw_uid, pw.pw_gid)
        for sub, mode in (("maildrop", 0o730), ("public", 0o710)):
            os.makedirs(f"{q}/{sub}")
            os.chown(f"{q}/{sub}", pw.pw_uid, gid_pd)
            os.chmod(f"{q}/{sub}", mode)
        for sub in ("data", "mail"):
            os.chown(f"{self.dir}/{sub}", pw.pw_uid, pw.pw_gid)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C", "LD_LIBRARY_PATH": lib,
               "MAIL_CONFIG": f"{self.dir}/etc"}
        self.log = open(f"{self.dir}/master.out", "w")
        self.proc = subprocess.Popen([os.path.join(lib, "sbin/master"), "-d", "-c",
                                      f"{self.dir}/etc"], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postfix master exited: {self.text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    s.settimeout(5)
                    if s.recv(512).startswith(b"220"):
                        s.sendall(b"QUIT\r\n")
                        return self.port
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"postfix did not answer on {self.port}: {self.text()}")

    def text(self):
        out = []
        for name in ("master.out", "maillog"):
            p = f"{self.dir}/{name}"
            if os.path.exists(p):
                out.append(open(p, errors="replace").read()[-3000:])
        return "\n".join(out)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # children that outlived the master (they exit on their own soon)
        deadline = time.monotonic() + 10
        while self._children() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in self._children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.log:
            self.log.close()
        if self.dir and not os.environ.get("OUTBOX_KEEP_POSTFIX"):
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- what it has ------------------------------------------------------
    def _children(self, name=None):
        """Processes of this instance: their command line names its config."""
        pids = []
        mark = f"{self.dir}/etc" if self.dir else None
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    env = f.read()
                with open(f"/proc/{p}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if mark and f"MAIL_CONFIG={mark}".encode() in env and (name is None or comm == name):
                pids.append(int(p))
        return pids

    def smtpd_pids(self):
        return self._children("smtpd")

    def kill_smtpd(self):
        n = 0
        for pid in self.smtpd_pids():
            try:
                os.kill(pid, signal.SIGKILL)
                n += 1
            except ProcessLookupError:
                pass
        return n

    def deliveries(self):
        """Message-ID -> number of copies delivered into the maildir."""
        out = {}
        base = f"{self.dir}/mail/all"
        parser = email.parser.BytesHeaderParser(policy=email.policy.compat32)
        for sub in ("new", "cur"):
            d = os.path.join(base, sub)
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                try:
                    with open(os.path.join(d, name), "rb") as f:
                        mid = (parser.parse(f).get("Message-ID") or "").strip()
                except OSError:
                    continue
                out[mid] = out.get(mid, 0) + 1
        return out

    def queued(self):
        """Messages still in the queue (not yet delivered)."""
        n = 0
        for sub in ("incoming", "active", "deferred", "hold"):
            for _, _, files in os.walk(f"{self.dir}/queue/{sub}"):
                n += len(files)
        return n

    def settle(self, timeout=60):
        """Wait until the queue is empty (every accepted copy delivered)."""
        deadline = time.monotonic() + timeout
        while self.queued() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.queued() == 0

    def count(self, message_id):
        return self.deliveries().get(message_id, 0)
