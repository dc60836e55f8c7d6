# SPDX-License-Identifier: ISC
"""bench/email_bench.py (run by bench/email_run.sh, `make bench-email`).

Relays, each its own process(es) on loopback: a private Postfix
(tests/servers/postfix_relay.py: Debian's postfix 3.7 binaries, own
config, queue and port, delivering to a maildir) with CHUNKING on as Debian
ships it ("postfix": libesmtp sends BDAT) and off ("postfix-nochunking":
DATA); a private OpenSMTPD
(bench/opensmtpd_relay.py: Debian's opensmtpd 6.8, own queue, delivering
to a maildir; skipped, with the reason, where it cannot run) and the
project's SMTP test server (tests/servers/smtp_server.py, aiosmtpd,
offering PIPELINING).  Against each, N emails per run, alternately:

  per-message  a plain client opening one SMTP session per message
               (Python smtplib: connect, greeting, EHLO, MAIL, RCPT, DATA,
               the message, QUIT; real SMTP, every reply awaited, no
               pipelining), shaped like the provider side: 2 processes (the
               2 workers) x CONC/2 sessions at once (their threads), the
               same message bytes the provider writes.  Rate = N / (last
               end - first start).
  provider     2 workers, [provider.email] at its defaults (4 threads,
               max_in_flight 32, sessions reused): N effects loaded as
               pending rows, rate = completed / (last completion - first
               send start, from the completing history rows).
  provider-1spm  (once) the provider with session_idle_ms = 0: one session
               per message through the same code.

With BENCH_EMAIL_RTTS (default "0,10,40") the comparison runs once per
round-trip time: at RTT > 0 both sides talk to the relay through
bench/delay_proxy.py (each chunk held for the one-way delay, the connect
delayed so that the greeting comes 2 RTT after it; loopback has no netem
here), so that round trips cost what they do on a network.

Each run also prints CPU ms per email of the sender side (the workers or
the client processes), PostgreSQL and the relay, and database transactions
per email: on a 2-core machine these, more than the rates, say where the
time goes.  Then a slow run: the provider (sessions of at most 5 messages,
so that greetings are many) against the test server, at RTT 10 ms, with
every 20th greeting stalling 5 s (timeout_ms 10000, the default): every effect must
end completed, none unknown.

Prints `email ratio (opensmtpd, RTT R ms): X.XX`, `email ratio (python
server, RTT R ms): X.XX` (mean provider rate / mean per-message rate) with
the provider runs' PostgreSQL CPU ms per email, and `false unknowns: N`.
Knobs: BENCH_EMAIL_N (2000), BENCH_EMAIL_SLOW_N (600), BENCH_EMAIL_ROUNDS
(2), BENCH_EMAIL_CONC (8: the per-message client's sessions at once),
BENCH_EMAIL_CONF ("threads = 8; ..." extra provider lines),
BENCH_EMAIL_RELAYS ("postfix,postfix-nochunking,opensmtpd,python"), BENCH_EMAIL_DELIVER (1; 0: OpenSMTPD queues without
delivering, smtpd -P mda), BENCH_EMAIL_NO_REUSE_RUN (1: at RTT 0 only),
BENCH_EMAIL_RTTS ("0,10,40"), BENCH_EMAIL_SLOW_RTT (10: the slow run's).
"""
import concurrent.futures
import email.utils
import os
import signal
import smtplib
import subprocess
import sys
import time
import uuid

import psycopg2

import opensmtpd_relay

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "servers"))
import postfix_relay  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, os.environ.get("BUILD_DIR", "build"))
WORK = os.environ.get("BENCH_WORK", "")
N = int(os.environ.get("BENCH_EMAIL_N", "2000"))
SLOW_N = int(os.environ.get("BENCH_EMAIL_SLOW_N", "600"))
CONC = int(os.environ.get("BENCH_EMAIL_CONC", "8"))
ROUNDS = int(os.environ.get("BENCH_EMAIL_ROUNDS", "2"))
DELIVER = os.environ.get("BENCH_EMAIL_DELIVER", "1") != "0"
RELAYS = os.environ.get("BENCH_EMAIL_RELAYS",
                        "postfix,postfix-nochunking,opensmtpd,python").split(",")
NO_REUSE_RUN = os.environ.get("BENCH_EMAIL_NO_REUSE_RUN", "1") != "0"
SLOW_RTT = float(os.environ.get("BENCH_EMAIL_SLOW_RTT", "10"))
RTTS = [float(x) for x in os.environ.get("BENCH_EMAIL_RTTS", "0,10,40").split(",") if x.strip()]
EXTRA = "\n".join(x.strip() for x in os.environ.get("BENCH_EMAIL_CONF", "").split(";") if x.strip())
PAYLOAD = ('{"from": "Bench <bench@example.com>", "subject": "Your receipt",'
           ' "text": "Hello,\\nthis is a bench message of a typical size.\\n"}')
T0 = time.time()


def log(msg):
    print("[%6.1fs] %s" % (time.time() - T0, msg), flush=True)


def conninfo():
    return "host=%s port=%s user=%s dbname=bench" % (
        os.environ["PGHOST"], os.environ["PGPORT"], os.environ.get("PGUSER", "postgres"))


DB = None     # connected on first use (the --client processes never use it)


def q(sql, args=None):
    global DB
    if DB is None:
        DB = psycopg2.connect(conninfo())
        DB.autocommit = True
    with DB.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall() if cur.description else None


class DelayProxy:
    """bench/delay_proxy.py in its own process, in front of a relay."""

    def __init__(self, target_port, rtt_ms):
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "delay_proxy.py"),
                                      "--target", "127.0.0.1:%d" % target_port,
                                      "--rtt-ms", str(rtt_ms)], stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Smtp:
    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "servers",
                                                                   "smtp_server.py")] + list(args),
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def tree_cpu(root):
    """CPU seconds used so far by process `root` and its descendants (those
    alive, and those reaped: their time is in the parent's cutime)."""
    parent, cpu = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)] = int(fields[1])
        cpu[int(d)] = sum(int(x) for x in fields[11:15])
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0)
        todo.extend(c for c, pp in parent.items() if pp == p)
    return total / os.sysconf("SC_CLK_TCK")


def postmaster_pid():
    with open(os.path.join(os.environ["PG_TEST_DIR"], "data", "postmaster.pid")) as f:
        return int(f.readline())


def postgres_cpu():
    """PostgreSQL's CPU seconds so far, less this script's own backend (its
    polling and its loads are not the dispatcher's cost)."""
    own = q("SELECT pg_backend_pid()")[0][0]
    return tree_cpu(postmaster_pid()) - tree_cpu(own)


class CpuMeter:
    """CPU per email of the sender side (this script's children: the workers
    or the client processes), PostgreSQL (less this script's own backend)
    and the relay, over one run."""
    relay_pid = None

    def __init__(self):
        t = os.times()
        self.children = t.children_user + t.children_system
        self.pg = postgres_cpu()
        self.relay = tree_cpu(self.relay_pid) if self.relay_pid else 0.0

    def report(self, n):
        t = os.times()
        sender = t.children_user + t.children_system - self.children
        pg = postgres_cpu() - self.pg
        relay = (tree_cpu(self.relay_pid) - self.relay) if self.relay_pid else 0.0
        self.pg_ms = 1000 * pg / n
        return "CPU ms/email: sender %.2f, postgres %.2f, relay %.2f" % (
            1000 * sender / n, self.pg_ms, 1000 * relay / n)


def worker(name, port, extra=""):
    ini = os.path.join(WORK, name + ".ini")
    with open(ini, "w") as f:
        f.write("""[database]
conninfo = {ci}
[dispatcher]
worker_name = {name}
provider_dir = {prov}
providers = email
[metrics]
listen =
[log]
level = warn
[provider.email]
server = 127.0.0.1:{port}
starttls = off
{extra}
{env_extra}
""".format(ci=conninfo(), name=name, prov=os.path.join(BUILD, "providers"), port=port,
           extra=extra, env_extra=EXTRA))
    err = open(os.path.join(WORK, name + ".log"), "w")
    return subprocess.Popen([os.path.join(BUILD, "outbox-dispatcher"), "--config", ini],
                            stdout=subprocess.DEVNULL, stderr=err,
                            env=dict(os.environ, AI_ACTIONS_ENABLED="true"))


def load(n, prefix):
    q("INSERT INTO workflow_runs (idempotency_key, state, payload_hash)"
      " SELECT %s || g, 'processing', 'h' FROM generate_series(1, %s) g", (prefix, n))
    q("INSERT INTO effect_outbox (idempotency_key, effect_type, target, payload, available_at)"
      " SELECT %s || g, 'email', 'user' || g || '@example.com', %s::jsonb,"
      " now() - interval '1 hour' + g * interval '1 microsecond'"
      " FROM generate_series(1, %s) g", (prefix, PAYLOAD, n))


def calls_inserted():
    """effect_calls rows inserted so far (one per claim or mark call), once
    the workers' sessions have ended and so reported their counts."""
    end = time.time() + 10
    while q("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'")[0][0] \
            and time.time() < end:
        time.sleep(0.05)
    q("SELECT pg_stat_clear_snapshot()")
    return q("SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables"
             " WHERE relname = 'effect_calls'")[0][0]


def provider_run(label, n, port, extra="", timeout=600):
    prefix = label + "-"
    load(n, prefix)
    calls0 = calls_inserted()
    started = q("SELECT now()")[0][0]
    meter = CpuMeter()
    procs = [worker("%s-w%d" % (label, i), port, extra) for i in range(2)]
    deadline = time.time() + timeout
    biggest_call = 0
    try:
        while time.time() < deadline:
            # Open effects are the live queue's rows; pending and sending
            # ones have a finite due time (unknown: 'infinity').
            left = q("SELECT count(*) FROM effect_outbox b JOIN effect_live l USING (effect_id)"
                     " WHERE b.idempotency_key LIKE %s AND l.available_at < 'infinity'",
                     (prefix + "%",))[0][0]
            # A call's row lives until the reaper finds none of its rows
            # sending any more (after its lease): seen by a poll a second.
            biggest_call = max(biggest_call, q("SELECT coalesce(max(cardinality(ids)), 0) FROM effect_calls"
                                               " WHERE created_at >= %s", (started,))[0][0])
            if left == 0:
                break
            for p in procs:
                if p.poll() is not None:
                    sys.exit("bench-email: a worker exited (rc %s)" % p.returncode)
            time.sleep(1.0)   # the rate comes from the rows' timestamps
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
    # An effect's state: its live row while open, else its latest
    # finishing history row.
    states = dict(q("SELECT coalesce(l.state, f.state), count(*) FROM effect_outbox b"
                    " LEFT JOIN effect_live l USING (effect_id)"
                    " LEFT JOIN LATERAL (SELECT h.state FROM effect_history h"
                    "                     WHERE h.created_at = b.created_at AND h.effect_id = b.effect_id"
                    "                       AND h.state IS NOT NULL"
                    "                     ORDER BY h.history_id DESC LIMIT 1) f ON true"
                    " WHERE b.idempotency_key LIKE %s GROUP BY 1", (prefix + "%",)))
    # The completing row is the provider call that finished the effect:
    # started when it went to sending, ended at the completion.
    done, span = q("SELECT count(*), extract(epoch FROM max(h.ended_at) - min(h.started_at))"
                   " FROM effect_outbox b JOIN effect_history h"
                   " ON h.created_at = b.created_at AND h.effect_id = b.effect_id"
                   " WHERE h.state = 'completed' AND b.idempotency_key LIKE %s",
                   (prefix + "%",))[0]
    rate = done / float(span) if span else 0.0
    outcomes = dict(q("SELECT h.outcome_class, count(*) FROM effect_outbox b JOIN effect_history h"
                      " ON h.created_at = b.created_at AND h.effect_id = b.effect_id"
                      " WHERE b.idempotency_key LIKE %s AND h.outcome_class IS NOT NULL GROUP BY 1",
                      (prefix + "%",)))
    ambiguous = outcomes.get("ambiguous", 0)
    retries = sum(c for o, c in outcomes.items() if o != "accepted")
    # The worker takes sends to `sending` in batches, one claim or mark
    # call each (one effect_calls row): how many emails a database round
    # trip of that step carries.
    marks = (calls_inserted() - calls0, biggest_call or "-")
    log("%-12s %5d emails  %7.1f emails/s  states %s  non-accepted attempts %d, ambiguous %d;"
        " %s; emails per mark call %.1f (max %s)"
        % (label, n, rate, states, retries, ambiguous, meter.report(n),
           n / float(marks[0] or 1), marks[1]))
    provider_run.pg_ms = meter.pg_ms
    return rate, states, ambiguous


def one_session(port, i):
    """One message, one SMTP session, as a plain client does it: connect, EHLO,
    MAIL, RCPT, DATA, the message, QUIT (smtplib; the EHLO name is given, so
    no name lookup happens per session)."""
    # The message the provider writes for the bench's payload, header for
    # header (message.c; libesmtp adds Date), so that both sides hand the
    # relay the same bytes to parse and store.
    msg = ("Date: %s\r\nFrom: Bench <bench@example.com>\r\nTo: user%d@example.com\r\n"
           "Subject: Your receipt\r\nMessage-ID: <plain-%d@outbox-dispatcher.invalid>\r\n"
           "X-Outbox-Effect-Id: %s\r\nMIME-Version: 1.0\r\n"
           "Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 7bit\r\n\r\n"
           "Hello,\r\nthis is a bench message of a typical size.\r\n"
           % (email.utils.formatdate(localtime=True), i, i, uuid.uuid4()))
    with smtplib.SMTP("127.0.0.1", port, local_hostname="bench.invalid", timeout=30) as s:
        s.sendmail("bench@example.com", ["user%d@example.com" % i], msg)


def client_process(port, first, count, threads):
    """One client process (run as `email_bench.py --client ...`): `threads`
    sessions at once; prints its first start, last end and failures."""
    t_first = time.time()
    failures = 0
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        for f in [ex.submit(one_session, port, i) for i in range(first, first + count)]:
            try:
                f.result()
            except (OSError, smtplib.SMTPException):
                failures += 1
    print("%.6f %.6f %d" % (t_first, time.time(), failures), flush=True)


def per_message_run(label, n, port):
    """The plain client, shaped like the provider side: 2 processes (the 2
    workers) with CONC/2 sessions at once each (their threads), so that the
    GIL of one Python process is not its limit.  Rate = N / (last end -
    first start) over both processes, as the provider's is over both
    workers."""
    procs, per = [], n // 2
    meter = CpuMeter()
    for k in range(2):
        count = per if k == 0 else n - per
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--client", str(port), str(k * per),
             str(count), str(max(1, CONC // 2))], stdout=subprocess.PIPE, text=True))
    rows = [p.communicate()[0].split() for p in procs]
    if any(p.returncode != 0 or len(r) != 3 for p, r in zip(procs, rows)):
        sys.exit("bench-email: the per-message client failed")
    start = min(float(r[0]) for r in rows)
    end = max(float(r[1]) for r in rows)
    failures = sum(int(r[2]) for r in rows)
    rate = (n - failures) / (end - start)
    log("%-12s %5d emails  %7.1f emails/s  (one session per message, 2 processes x %d sessions"
        " at once, %d failed); %s" % (label, n, rate, max(1, CONC // 2), failures,
                                     meter.report(n)))
    return rate


def compare(relay_name, port, relay_pid, rounds, rtt):
    """Provider and plain client alternately, `rounds` times each; then once
    (at RTT 0) the provider with one session per message (session_idle_ms =
    0).  At rtt > 0 both go through a delaying proxy.  Returns the ratio and
    the provider runs' mean PostgreSQL CPU ms per email."""
    CpuMeter.relay_pid = relay_pid
    proxy = DelayProxy(port, rtt) if rtt > 0 else None
    name = "%s-rtt%g" % (relay_name, rtt)
    try:
        via = proxy.port if proxy else port
        per_message_run("warm-up", min(200, N), via)
        prov, plain, pg = [], [], []
        for r in range(rounds):
            plain.append(per_message_run("per-message", N, via))
            prov.append(provider_run("%s-provider%d" % (name, r), N, via)[0])
            pg.append(provider_run.pg_ms)
        once = provider_run("%s-provider-1spm" % name, N, via,
                            extra="session_idle_ms = 0")[0] if NO_REUSE_RUN and rtt == 0 else None
    finally:
        if proxy:
            proxy.stop()
    ratio = sum(prov) / sum(plain)
    log("%s, RTT %g ms: email ratio %.2f (provider %s emails/s, per-message client %s; provider "
        "with one session per message %s); PostgreSQL CPU ms per email %s"
        % (relay_name, rtt, ratio, " ".join("%.1f" % x for x in prov),
           " ".join("%.1f" % x for x in plain), "%.1f" % once if once else "not run",
           " ".join("%.2f" % x for x in pg)))
    return ratio, sum(pg) / len(pg)


def main():
    log("machine: %d CPUs, load %s (shared: figures move with other work)"
        % (os.cpu_count(), open("/proc/loadavg").read().split()[:3]))
    ratios = {}
    for name in ("postfix", "postfix-nochunking"):
        if name not in RELAYS:
            continue
        why = postfix_relay.available()
        if why:
            log("%s: skipped: %s" % (name, why))
            continue
        relay = postfix_relay.PostfixRelay(chunking=name == "postfix")
        relay.start()
        try:
            log("%s on 127.0.0.1:%d (private config and queue, CHUNKING %s, maildir delivery)"
                % (name, relay.port, "on" if relay.chunking else "off"))
            for rtt in RTTS:
                ratios[(name, rtt)] = compare(name, relay.port, relay.proc.pid, ROUNDS, rtt)
            relay.settle(60)
            log("%s: %d messages delivered, %d Message-IDs twice" % (
                name, sum(relay.deliveries().values()),
                sum(1 for m, c in relay.deliveries().items() if c > 1 and not m.startswith("<plain-"))))
        finally:
            relay.stop()
    why = opensmtpd_relay.unavailable() if "opensmtpd" in RELAYS else "not asked for"
    if why:
        log("opensmtpd: skipped: %s" % why)
    else:
        relay = opensmtpd_relay.OpenSmtpd(WORK, deliver=DELIVER)
        try:
            log("opensmtpd %s on 127.0.0.1:%d (private queue, %s)"
                % (relay.version(), relay.port,
                   "maildir delivery" if DELIVER else "delivery paused: smtpd -P mda"))
            for rtt in RTTS:
                ratios[("opensmtpd", rtt)] = compare("opensmtpd", relay.port, relay.proc.pid,
                                                     ROUNDS, rtt)
            log("opensmtpd: %d messages delivered to the maildir so far" % relay.delivered())
        finally:
            relay.stop()
    if "python" in RELAYS:
        smtp = Smtp("--pipelining")
        try:
            for rtt in RTTS:
                ratios[("python server", rtt)] = compare("python", smtp.port, smtp.proc.pid,
                                                         ROUNDS, rtt)
        finally:
            smtp.stop()

    CpuMeter.relay_pid = None
    slow = Smtp("--slow-greeting", "20:5000", "--pipelining")
    proxy = DelayProxy(slow.port, SLOW_RTT) if SLOW_RTT > 0 else None
    try:
        # Sessions of 5 messages, so that many greetings happen (with the
        # default 100 a run this size opens a handful of sessions).
        _, states, ambiguous = provider_run("slow", SLOW_N, proxy.port if proxy else slow.port,
                                            extra="session_max_messages = 5")
    finally:
        if proxy:
            proxy.stop()
        slow.stop()
    false_unknown = states.get("unknown", 0)
    log("slow greetings (1 in 20 stalls 5 s, RTT %g ms): %d emails, completed %d, unknown %d, failed %d, "
        "ambiguous attempts %d" % (SLOW_RTT, SLOW_N, states.get("completed", 0), false_unknown,
                                   states.get("failed", 0), ambiguous))
    log("load at the end %s" % open("/proc/loadavg").read().split()[:3])
    for (relay, rtt), (ratio, pg_ms) in ratios.items():
        print("email ratio (%s, RTT %g ms): %.2f  (PostgreSQL CPU %.2f ms per email)"
              % (relay, rtt, ratio, pg_ms))
    print("false unknowns: %d" % false_unknown)
    return 0 if false_unknown == 0 and states.get("completed", 0) == SLOW_N else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        client_process(*(int(a) for a in sys.argv[2:6]))
        sys.exit(0)
    sys.exit(main())
