# SPDX-License-Identifier: ISC
# outbox-dispatcher build.
#
#   make              build/outbox-dispatcher, build/outboxctl, build/outbox-console,
#                     build/providers/*.so
#   make test         sanitizer build + every suite against a throwaway PostgreSQL
#   make test-cold    the README's test command as a new machine runs it: a fresh
#                     clone of HEAD, empty HOME, TMPDIR, npm and n8n caches (scripts/test-cold.sh)
#   make install PREFIX=/usr/local [DESTDIR=...] [LIBDIR=...] [UNITDIR=...]
#   make man          build/man/*.8 from the --help texts (help2man)
#   make deb          build/deb/outbox-dispatcher_VERSION_ARCH.deb (debian/)
#   make bench / make bench-quick / make bench-email / make bench-levers / make bench-insert / make bench-peer / make bench-history
#   make chaos
#   make cppcheck     static analysis (kept clean)
#   make schema       sql/schema.sql from a fresh install (after changing sql/)
#
# BUILD=dir puts objects elsewhere (the test build uses build-asan), so two
# builds never share object files.

PREFIX    ?= /usr/local
# The plugin directory is compiled in (the worker's default provider_dir).
# The Debian package sets LIBDIR=/usr/lib/<multiarch triplet>.
LIBDIR    ?= $(PREFIX)/lib
PLUGINDIR ?= $(LIBDIR)/outbox-dispatcher/providers
UNITDIR   ?= $(PREFIX)/lib/systemd/system
BUILD     ?= build
# The version: debian/changelog's, plus, in a git checkout, what commit it
# is (no tags are kept: the commit count orders builds, the hash names
# them, .dirty marks uncommitted changes), e.g. 0.1.0+git812.g71088d84f.
# Shown by --version, in /metrics (outbox_build_info) and as the package's
# version (make deb writes it into the copy's changelog).  A tree without
# .git (git archive, the package's source copy) has the changelog's.
BASE_VERSION := $(shell sed -n '1s/^[^(]*(\([^)]*\)).*/\1/p' debian/changelog)
GIT_REV   := $(shell [ -e .git ] && git rev-parse --short=9 HEAD 2>/dev/null)
ifneq ($(GIT_REV),)
VERSION   ?= $(BASE_VERSION)+git$(shell git rev-list --count HEAD).g$(GIT_REV)$(shell git diff --quiet HEAD -- 2>/dev/null || echo .dirty)
else
VERSION   ?= $(BASE_VERSION)
endif
# Written when it changes (objects that include it rebuild then); not by
# `make print-version`, which only says it, nor by `make clean`, which
# must not make what it removes (nor write under a BUILD it refuses).
VERSION_H := $(BUILD)/gen/version.h
WRITES_VERSION_H := $(if $(MAKECMDGOALS),$(filter-out print-version clean,$(MAKECMDGOALS)),all)
ifneq ($(WRITES_VERSION_H),)
$(shell mkdir -p $(BUILD)/gen && printf '#define OUTBOX_VERSION "%s"\n' '$(VERSION)' | cmp -s - $(VERSION_H) || printf '#define OUTBOX_VERSION "%s"\n' '$(VERSION)' > $(VERSION_H))
endif
CC        ?= cc
PKGS      := libpq libcurl libesmtp-1.0 jansson libevent libevent_pthreads inih libsystemd libssl libcrypto
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS))
PKG_LIBS   := $(shell pkg-config --libs $(PKGS))

WARN      := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes \
             -Wno-unused-parameter -Wformat=2
# CFLAGS, CPPFLAGS and LDFLAGS are the user's (make CFLAGS=-O0 works);
# what the build needs is added to them, never replaced by them.
CFLAGS    ?= -O2 -g
REQ_CFLAGS := -std=c11 -D_GNU_SOURCE $(WARN) -fPIC -Ilib -Iproviders -I$(BUILD)/gen \
              -DOUTBOX_LIBDIR=\"$(PLUGINDIR)\" $(PKG_CFLAGS)
ALL_CFLAGS = $(REQ_CFLAGS) $(CPPFLAGS) $(CFLAGS) $(EXTRA_CFLAGS)
ALL_LDFLAGS = $(LDFLAGS) $(EXTRA_LDFLAGS)

# One folder per program, each a wildcard: dispatcher/ (the worker,
# outbox-dispatcher), outboxctl/ (the operator CLI), console/ (the web
# console).  lib/ is what they share: the growing string and the one
# allocation policy (text.c), util, logs, config reading, the database
# connection, migrations, JSON as text, hostnames, secret scrubbing.
LIB_SRC   := $(sort $(wildcard lib/*.c))
DAEMON_SRC := $(sort $(wildcard dispatcher/*.c))
CTL_SRC   := $(sort $(wildcard outboxctl/*.c))
# The web console (console/, docs/console.md): a program of its own, the
# only one linking libmicrohttpd.
CONSOLE_SRC := $(sort $(wildcard console/*.c))
CONSOLE_CFLAGS := $(shell pkg-config --cflags libmicrohttpd) -DOUTBOX_CONSOLE_VERSION=\"$(VERSION)\"
CONSOLE_LIBS := $(shell pkg-config --libs libmicrohttpd)
# A plugin is providers/NAME.c or the files providers/NAME/*.c;
# providers/lib/*.c (the plugins' own helpers: libcurl on the loop, URLs,
# SSRF rules, signing, http's lookup) is linked into each, and of lib/ the
# members it calls, from lib/'s archive (text.c always).  A plugin exports
# only outbox_provider_entry (providers/plugin.map): its own copies of
# these are what it calls, never the loading daemon's.
PROV_SRC  := $(sort $(wildcard providers/*.c))
PROV_DIRS := $(filter-out lib,$(notdir $(patsubst %/,%,$(sort $(dir $(wildcard providers/*/*.c))))))
PROV_LIB_SRC := $(sort $(wildcard providers/lib/*.c))
PLUGINS   := $(patsubst providers/%.c,$(BUILD)/providers/outbox_%.so,$(PROV_SRC)) \
             $(patsubst %,$(BUILD)/providers/outbox_%.so,$(PROV_DIRS))

LIB_OBJ   := $(patsubst %.c,$(BUILD)/obj/%.o,$(LIB_SRC))
# The programs link all of lib/ and the compiled-in migrations.
CORE_OBJ  := $(LIB_OBJ) $(BUILD)/obj/migrations.o
LIB_A     := $(BUILD)/lib/liboutbox.a
DAEMON_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(DAEMON_SRC))
CTL_OBJ   := $(patsubst %.c,$(BUILD)/obj/%.o,$(CTL_SRC))
CONSOLE_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(CONSOLE_SRC))
PROV_LIB_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(PROV_LIB_SRC))

UNIT_SRC  := $(sort $(wildcard tests/unit/test_*.c))
UNIT_BIN  := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))

MIGRATIONS := $(sort $(wildcard sql/[0-9]*.sql))
FUNCTION_SQL := $(sort $(wildcard sql/functions/*.sql))

.PHONY: all clean install print-version test test-cold unit cppcheck bench bench-quick bench-email bench-levers bench-insert bench-peer bench-history chaos demo fuzz man deb schema
all: $(BUILD)/outbox-dispatcher $(BUILD)/outboxctl $(BUILD)/outbox-console $(PLUGINS)

# -MMD -MP: each object's header dependencies, read back below.
$(BUILD)/obj/%.o: %.c Makefile
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	@$(CC) $(ALL_CFLAGS) -MMD -MP -c -o $@ $<

# The migrations are compiled into outboxctl: an installed binary always
# carries the schema it was built for.
$(BUILD)/gen/migrations.c: $(MIGRATIONS) $(FUNCTION_SQL) lib/gen_migrations.sh
	@mkdir -p $(dir $@)
	sh lib/gen_migrations.sh $(MIGRATIONS) $(FUNCTION_SQL) > $@.tmp && mv $@.tmp $@

$(BUILD)/obj/migrations.o: $(BUILD)/gen/migrations.c lib/migrate.h Makefile
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	@$(CC) $(ALL_CFLAGS) -c -o $@ $<

$(BUILD)/outbox-dispatcher: $(DAEMON_OBJ) $(CORE_OBJ)
	@echo "  LD      $@"
	@$(CC) $(ALL_CFLAGS) -rdynamic -o $@ $^ $(ALL_LDFLAGS) $(PKG_LIBS) -ldl -lpthread -lm

$(BUILD)/outboxctl: $(CTL_OBJ) $(CORE_OBJ)
	@echo "  LD      $@"
	@$(CC) $(ALL_CFLAGS) -o $@ $^ $(ALL_LDFLAGS) $(PKG_LIBS) -lm

$(CONSOLE_OBJ): EXTRA_CFLAGS += $(CONSOLE_CFLAGS)
$(BUILD)/outbox-console: $(CONSOLE_OBJ) $(CORE_OBJ)
	@echo "  LD      $@"
	@$(CC) $(ALL_CFLAGS) -o $@ $^ $(ALL_LDFLAGS) $(CONSOLE_LIBS) $(PKG_LIBS) -lpthread -lm

.SECONDEXPANSION:
# The objects of some sources, for the prerequisites below: no % in it, as
# a pattern rule puts its stem into every % of its prerequisites (a
# patsubst there listed the .c files themselves, compiled at link time
# without their header dependencies).  The plugins' objects are named as
# targets, so that the unit-test rules that link them are not passed over
# for the generic test_% rule.
objects_of = $(addprefix $(BUILD)/obj/,$(addsuffix .o,$(basename $(1))))
PROV_OBJ  := $(call objects_of,$(wildcard providers/*.c providers/*/*.c))
$(PROV_OBJ): Makefile
$(BUILD)/providers/outbox_%.so: $$(call objects_of,$$(wildcard providers/$$*.c providers/$$*/*.c)) $(PROV_LIB_OBJ) $(LIB_A)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	@$(CC) $(ALL_CFLAGS) -shared -Wl,--version-script=providers/plugin.map -o $@ $(filter %.o,$^) \
	  $(LIB_A) $(ALL_LDFLAGS) $(PKG_LIBS) -lpthread
# lib/ as an archive, for the plugins: the linker takes only the members a
# plugin calls (and what those call), so a plugin carries no database or
# config code it never runs.
$(LIB_A): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	@echo "  AR      $@"
	@rm -f $@ && $(AR) rcs $@ $^
$(PLUGINS): providers/plugin.map

# Unit tests (cmocka) link the objects they test; none includes a .c file.
# They reach the worker's headers too (dispatcher/: decide.h, hosts.h, ...).
UNIT_CFLAGS := -Idispatcher
UNIT_DAEMON_OBJ := $(patsubst %,$(BUILD)/obj/dispatcher/%.o,policy hosts metrics metrics_http sdnotify decide)
$(BUILD)/tests/test_%: tests/unit/test_%.c $(CORE_OBJ) $(UNIT_DAEMON_OBJ) $(PROV_LIB_OBJ)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	@$(CC) $(ALL_CFLAGS) $(UNIT_CFLAGS) -o $@ $^ $(ALL_LDFLAGS) $(PKG_LIBS) $(shell pkg-config --libs cmocka) -lm

# A plugin's own unit tests (tests/unit/test_NAME_PART.c) also link the
# objects of providers/NAME/ but its glue (NAME.c).
$(BUILD)/tests/test_email_%: tests/unit/test_email_%.c $(CORE_OBJ) $(PROV_LIB_OBJ) \
  $$(call objects_of,$$(filter-out providers/email/email.c,$$(wildcard providers/email/*.c)))
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	@$(CC) $(ALL_CFLAGS) $(UNIT_CFLAGS) -o $@ $^ $(ALL_LDFLAGS) $(PKG_LIBS) $(shell pkg-config --libs cmocka) -lpthread -lm

# effect.c's phase mover, with what effect.c calls (hosts, metrics, the
# provider lookup).
$(BUILD)/tests/test_effect: tests/unit/test_effect.c $(CORE_OBJ) $(PROV_LIB_OBJ) \
  $(patsubst %,$(BUILD)/obj/dispatcher/%.o,effect hosts metrics plugin)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	@$(CC) $(ALL_CFLAGS) $(UNIT_CFLAGS) -o $@ $^ $(ALL_LDFLAGS) $(PKG_LIBS) $(shell pkg-config --libs cmocka) -ldl -lm

# Likewise the http provider's (tests/unit/test_http_PART.c): providers/http/
# but its glue (http.c).
$(BUILD)/tests/test_http_%: tests/unit/test_http_%.c $(CORE_OBJ) $(PROV_LIB_OBJ) \
  $$(call objects_of,$$(filter-out providers/http/http.c,$$(wildcard providers/http/*.c)))
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	@$(CC) $(ALL_CFLAGS) $(UNIT_CFLAGS) -o $@ $^ $(ALL_LDFLAGS) $(PKG_LIBS) $(shell pkg-config --libs cmocka) -lm

unit: $(UNIT_BIN)
	@set -e; for t in $(UNIT_BIN); do echo "== $$t"; $$t; done

# The test build: AddressSanitizer + UndefinedBehaviorSanitizer, separate
# objects; tests/run.sh starts PostgreSQL and runs every suite.
SAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
test:
	$(MAKE) BUILD=build-asan CFLAGS="$(SAN_FLAGS)" EXTRA_LDFLAGS="-fsanitize=address,undefined" all $(patsubst $(BUILD)/%,build-asan/%,$(UNIT_BIN))
	BUILD_DIR=build-asan sh tests/run.sh

# The README's test command on a machine that never ran it (tests/README.md,
# "A cold run"): the real caches are left alone.
test-cold:
	sh scripts/test-cold.sh

# sql/schema.sql, the fresh-install schema in one file, regenerated from
# the migrations and sql/functions/ (a throwaway PostgreSQL of its own).
schema: $(BUILD)/outboxctl
	BUILD_DIR=$(BUILD) sh scripts/schema.sh

cppcheck:
	cppcheck --error-exitcode=1 --enable=warning,performance,portability --inline-suppr \
	  --std=c11 -q -Ilib -Iproviders -D__GNUC__ --suppress=missingIncludeSystem \
	  lib dispatcher outboxctl console providers

bench: all
	sh bench/run.sh

bench-quick: all
	QUICK=1 sh bench/run.sh

# The email provider: sessions reused vs one session per message (bench/README.md).
bench-email: all
	sh bench/email_run.sh

# Claim + completion PostgreSQL CPU and WAL per effect, this tree's schema
# against LEVERS_BASELINE_REF's (default 2d13b03), interleaved call by call
# at 16/64/128 rows per call (bench/README.md).
bench-levers: all
	sh bench/levers.sh

# The producer's plain INSERT as a producer login, one row per transaction
# and in bulk, this tree against LEVERS_BASELINE_REF's schema (bench/README.md).
bench-insert: all
	sh bench/insert_cost.sh

# The dispatcher beside graphile-worker on identical HTTP work (bench/README.md).
bench-peer: all
	sh bench/peer/peer.sh

# PostgreSQL CPU per effect with a long history and a held snapshot (bench/README.md).
bench-history: all
	sh bench/peer/history.sh

chaos: all
	sh tests/chaos/run.sh

demo: all
	sh tests/demo.sh

# libFuzzer targets (clang), FUZZ_SECONDS each (default 20).
fuzz:
	sh tests/fuzz/run.sh

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PLUGINDIR) \
	  $(DESTDIR)$(PREFIX)/share/outbox-dispatcher/sql/functions $(DESTDIR)/etc/outbox-dispatcher \
	  $(DESTDIR)$(UNITDIR)
	install -m 0755 $(BUILD)/outbox-dispatcher $(BUILD)/outboxctl $(BUILD)/outbox-console \
	  $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 $(PLUGINS) $(DESTDIR)$(PLUGINDIR)/
	install -m 0644 $(MIGRATIONS) $(DESTDIR)$(PREFIX)/share/outbox-dispatcher/sql/
	install -m 0644 $(FUNCTION_SQL) $(DESTDIR)$(PREFIX)/share/outbox-dispatcher/sql/functions/
	install -m 0644 dispatcher.ini.example systemd/environment.example $(DESTDIR)$(PREFIX)/share/outbox-dispatcher/
	install -d -m 0700 $(DESTDIR)/etc/outbox-dispatcher/credentials
	[ -f $(DESTDIR)/etc/outbox-dispatcher/environment ] || \
	  install -m 0644 systemd/environment.example $(DESTDIR)/etc/outbox-dispatcher/environment
	for u in systemd/*.service systemd/*.target systemd/*.timer; do [ -f "$$u" ] || continue; \
	  sed 's#@PREFIX@#$(PREFIX)#g' "$$u" > $(DESTDIR)$(UNITDIR)/$$(basename $$u); done

# Man pages from the binaries' own --help texts plus docs/man/NAME.h2m
# (description, files, environment, signals): help2man, see docs/man/README.
MANPAGES := $(BUILD)/man/outbox-dispatcher.8 $(BUILD)/man/outboxctl.8 $(BUILD)/man/outbox-console.8
man: $(MANPAGES)

$(BUILD)/man/%.8: $(BUILD)/% docs/man/%.h2m
	@mkdir -p $(dir $@)
	help2man --no-info --section=8 --version-string="$(VERSION)" \
	  --include=docs/man/$*.h2m --output=$@.tmp $< && mv $@.tmp $@

# The Debian package, built from a copy of the tree under $(BUILD)/deb/src
# (dpkg-buildpackage writes beside its source and cleans its own build dir,
# so the working tree and its build trees stay untouched).
DEB_JOBS ?= 2
deb:
	rm -rf $(BUILD)/deb && mkdir -p $(BUILD)/deb/src
	tar -c --exclude=./.git --exclude='./build' --exclude='./build-*' --exclude=./bench/out . \
	  | tar -x -C $(BUILD)/deb/src
	if [ "$(VERSION)" != "$(BASE_VERSION)" ]; then \
	  { printf 'outbox-dispatcher (%s) unstable; urgency=medium\n\n  * Built from commit %s.\n\n -- %s  %s\n\n' \
	      '$(VERSION)' '$(GIT_REV)' "$$(sed -n 's/^ -- \(.*>\)  .*/\1/p' debian/changelog | head -1)" \
	      "$$(git log -1 --format=%aD)"; cat debian/changelog; } > $(BUILD)/deb/src/debian/changelog; \
	fi
	cd $(BUILD)/deb/src && env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL \
	  dpkg-buildpackage -us -uc -b -J$(DEB_JOBS)
	@ls $(BUILD)/deb/*.deb

# The version this tree builds (tests compare it with the binaries' and the package's).
print-version:
	@echo '$(VERSION)'

# The default and test trees, and BUILD when it names another one.
clean:
	@case '$(BUILD)' in ''|.|./|..|../|/) echo "make clean: refusing BUILD='$(BUILD)'" >&2; exit 1;; esac
	rm -rf build build-* '$(BUILD)'

# Objects are kept between builds (pattern-rule intermediates otherwise go),
# and every object's header dependencies come from its .d file.
.SECONDARY:
-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
