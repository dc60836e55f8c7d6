# outbox-dispatcher build.
#
#   make              build/outbox-dispatcher, build/outboxctl, build/providers/*.so
#   make test         sanitizer build + every suite against a throwaway PostgreSQL
#   make install PREFIX=/usr/local [DESTDIR=...]
#   make bench / make bench-quick / make chaos
#   make cppcheck     static analysis (kept clean)
#
# BUILD=dir puts objects elsewhere (the test build uses build-asan), so two
# builds never share object files.

PREFIX    ?= /usr/local
BUILD     ?= build
CC        ?= cc
PKGS      := libpq libcurl libesmtp-1.0 jansson libevent libevent_pthreads inih libsystemd libssl libcrypto
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS))
PKG_LIBS   := $(shell pkg-config --libs $(PKGS))

WARN      := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes \
             -Wno-unused-parameter -Wformat=2
OPT       ?= -O2 -g
CFLAGS    := $(OPT) -DOUTBOX_LIBDIR=\"$(PREFIX)/lib/outbox-dispatcher/providers\" -std=c11 -D_GNU_SOURCE $(WARN) -fPIC -Idispatcher -Iproviders $(PKG_CFLAGS) $(EXTRA_CFLAGS)
LDFLAGS   += $(EXTRA_LDFLAGS)

# Core objects shared by the daemon and outboxctl.
CORE_SRC  := dispatcher/util.c dispatcher/log.c dispatcher/config.c dispatcher/db.c \
             dispatcher/migrate.c
DAEMON_SRC := dispatcher/main.c dispatcher/worker.c dispatcher/plugin.c dispatcher/hosts.c \
              dispatcher/policy.c dispatcher/metrics.c dispatcher/sdnotify.c \
              providers/lib/json_text.c
CTL_SRC   := $(sort $(wildcard dispatcher/outboxctl*.c))
# Every providers/NAME.c is one plugin; providers/lib/*.c is linked into each.
PROV_SRC  := $(sort $(wildcard providers/*.c))
PROV_LIB_SRC := $(sort $(wildcard providers/lib/*.c))
PLUGINS   := $(patsubst providers/%.c,$(BUILD)/providers/outbox_%.so,$(PROV_SRC))

CORE_OBJ  := $(patsubst %.c,$(BUILD)/obj/%.o,$(CORE_SRC)) $(BUILD)/obj/migrations.o
DAEMON_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(DAEMON_SRC))
CTL_OBJ   := $(patsubst %.c,$(BUILD)/obj/%.o,$(CTL_SRC))
PROV_LIB_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(PROV_LIB_SRC))

UNIT_SRC  := $(sort $(wildcard tests/unit/test_*.c))
UNIT_BIN  := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))

MIGRATIONS := $(sort $(wildcard sql/[0-9]*.sql))
FUNCTION_SQL := $(sort $(wildcard sql/functions/*.sql))

.PHONY: all clean install test unit cppcheck bench bench-quick chaos demo fuzz
all: $(BUILD)/outbox-dispatcher $(BUILD)/outboxctl $(PLUGINS)

$(BUILD)/obj/%.o: %.c $(wildcard dispatcher/*.h providers/*.h providers/lib/*.h) Makefile
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	@$(CC) $(CFLAGS) -c -o $@ $<

# The migrations are compiled into outboxctl: an installed binary always
# carries the schema it was built for.
$(BUILD)/gen/migrations.c: $(MIGRATIONS) $(FUNCTION_SQL) dispatcher/gen_migrations.sh
	@mkdir -p $(dir $@)
	sh dispatcher/gen_migrations.sh $(MIGRATIONS) $(FUNCTION_SQL) > $@.tmp && mv $@.tmp $@

$(BUILD)/obj/migrations.o: $(BUILD)/gen/migrations.c dispatcher/migrate.h
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	@$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/outbox-dispatcher: $(DAEMON_OBJ) $(CORE_OBJ)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) -rdynamic -o $@ $^ $(LDFLAGS) $(PKG_LIBS) -ldl -lpthread -lm

$(BUILD)/outboxctl: $(CTL_OBJ) $(CORE_OBJ)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) -o $@ $^ $(LDFLAGS) $(PKG_LIBS) -lm

$(BUILD)/providers/outbox_%.so: $(BUILD)/obj/providers/%.o $(PROV_LIB_OBJ)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) -shared -o $@ $^ $(LDFLAGS) $(PKG_LIBS) -lpthread

# Unit tests (cmocka) link the core objects they test.
# (Some tests #include the .c they test, hence the sources as prerequisites.)
$(BUILD)/tests/test_%: tests/unit/test_%.c $(CORE_OBJ) $(BUILD)/obj/dispatcher/policy.o $(BUILD)/obj/dispatcher/hosts.o $(PROV_LIB_OBJ) $(wildcard dispatcher/*.c dispatcher/*.h providers/*.c)
	@mkdir -p $(dir $@)
	@echo "  LD      $@"
	@$(CC) $(CFLAGS) -o $@ $(filter-out dispatcher/% providers/%,$^) $(LDFLAGS) $(PKG_LIBS) $(shell pkg-config --libs cmocka) -lm

unit: $(UNIT_BIN)
	@set -e; for t in $(UNIT_BIN); do echo "== $$t"; $$t; done

# The test build: AddressSanitizer + UndefinedBehaviorSanitizer, separate
# objects; tests/run.sh starts PostgreSQL and runs every suite.
SAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
test:
	$(MAKE) BUILD=build-asan OPT="$(SAN_FLAGS)" EXTRA_LDFLAGS="-fsanitize=address,undefined" all $(patsubst $(BUILD)/%,build-asan/%,$(UNIT_BIN))
	BUILD_DIR=build-asan sh tests/run.sh

cppcheck:
	cppcheck --error-exitcode=1 --enable=warning,performance,portability --inline-suppr \
	  --std=c11 -q -Idispatcher -Iproviders -D__GNUC__ --suppress=missingIncludeSystem \
	  dispatcher providers

bench: all
	sh bench/run.sh

bench-quick: all
	QUICK=1 sh bench/run.sh

chaos: all
	sh tests/chaos/run.sh

demo: all
	sh tests/demo.sh

# libFuzzer targets (clang), FUZZ_SECONDS each (default 20).
fuzz:
	sh tests/fuzz/run.sh

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/outbox-dispatcher/providers \
	  $(DESTDIR)$(PREFIX)/share/outbox-dispatcher/sql/functions $(DESTDIR)/etc/outbox-dispatcher \
	  $(DESTDIR)$(PREFIX)/lib/systemd/system
	install -m 0755 $(BUILD)/outbox-dispatcher $(BUILD)/outboxctl $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 $(PLUGINS) $(DESTDIR)$(PREFIX)/lib/outbox-dispatcher/providers/
	install -m 0644 $(MIGRATIONS) $(DESTDIR)$(PREFIX)/share/outbox-dispatcher/sql/
	install -m 0644 $(FUNCTION_SQL) $(DESTDIR)$(PREFIX)/share/outbox-dispatcher/sql/functions/
	install -m 0644 dispatcher.ini.example systemd/environment.example $(DESTDIR)$(PREFIX)/share/outbox-dispatcher/
	install -d -m 0700 $(DESTDIR)/etc/outbox-dispatcher/credentials
	[ -f $(DESTDIR)/etc/outbox-dispatcher/environment ] || \
	  install -m 0600 systemd/environment.example $(DESTDIR)/etc/outbox-dispatcher/environment
	for u in systemd/*.service systemd/*.target; do [ -f "$$u" ] || continue; \
	  sed 's#@PREFIX@#$(PREFIX)#g' "$$u" > $(DESTDIR)$(PREFIX)/lib/systemd/system/$$(basename $$u); done

clean:
	rm -rf build build-asan build-*
