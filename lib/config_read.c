/* SPDX-License-Identifier: ISC */
/*
 * config_read.c: reading the INI file (or a string) into the entries of a
 * struct config, with inih: each key once, inside a [section], lines up
 * to CONFIG_MAX_LINE long, every error naming the file and the line.
 * What the keys mean, and checking values against the key tables:
 * config.c.
 *
 * inih is built by Debian without line numbers in its callback, so the
 * reader passed to ini_parse_stream() counts lines itself: the handler is
 * always called for the line the reader returned last.
 */
#include "config.h"

#include <errno.h>
#include <ini.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "util.h"

/* The longest line a config file may have (allow_hosts, conninfo). */
#define CONFIG_MAX_LINE 65536
/* What reader() hands inih in place of a long value. */
#define LONG_VALUE_MARK "\001long"

struct parse_ctx {
	struct config *cfg;
	FILE *fp;
	const char *text;     /* string input */
	size_t pos;
	int line;
	char *err;
	size_t errlen;
	bool failed;
	/* The value of the line the reader returned last when that line was
	 * too long for inih's buffer (see reader()); NULL otherwise. */
	char *long_value;
};

static void entry_free(struct conf_entry *e)
{
	free(e->section);
	free(e->key);
	free(e->value);
	if (e->resolved) {
		/* Secrets do not linger in freed memory. */
		memset(e->resolved, 0, strlen(e->resolved));
		free(e->resolved);
	}
}

void config_free(struct config *cfg)
{
	if (cfg == NULL)
		return;
	for (size_t i = 0; i < cfg->n; i++)
		entry_free(&cfg->entries[i]);
	free(cfg->entries);
	free(cfg->path);
	free(cfg);
}

const struct conf_entry *config_find(const struct config *cfg, const char *section,
                                     const char *key)
{
	for (size_t i = 0; i < cfg->n; i++)
		if (strcmp(cfg->entries[i].section, section) == 0 &&
		    strcmp(cfg->entries[i].key, key) == 0)
			return &cfg->entries[i];
	return NULL;
}

static int on_entry(void *user, const char *section, const char *name, const char *value)
{
	struct parse_ctx *ctx = user;
	struct config *cfg = ctx->cfg;
	const struct conf_entry *dup;

	if (ctx->failed)
		return 0;
	if (ctx->long_value && strcmp(value, LONG_VALUE_MARK) == 0)
		value = ctx->long_value;
	if (section[0] == '\0') {
		snprintf(ctx->err, ctx->errlen, "%s:%d: %s: key outside of any [section]",
		         cfg->path, ctx->line, name);
		ctx->failed = true;
		return 0;
	}
	dup = config_find(cfg, section, name);
	if (dup) {
		snprintf(ctx->err, ctx->errlen, "%s:%d: [%s] %s: set twice (first on line %d)",
		         cfg->path, ctx->line, section, name, dup->line);
		ctx->failed = true;
		return 0;
	}
	if (cfg->n == cfg->cap) {
		cfg->cap = cfg->cap ? cfg->cap * 2 : 32;
		cfg->entries = text_realloc(cfg->entries, cfg->cap * sizeof(*cfg->entries));
	}
	cfg->entries[cfg->n++] = (struct conf_entry){
		.section = text_strdup(section), .key = text_strdup(name), .value = text_strdup(value),
		.line = ctx->line,
	};
	return 1;
}

/* One line of input, without its newline, into a growing buffer; at most
 * CONFIG_MAX_LINE characters are kept, *more is set when there were more. */
static bool next_line(struct parse_ctx *ctx, struct strbuf *b, bool *more)
{
	int c;

	*more = false;
	if (ctx->fp) {
		if ((c = getc(ctx->fp)) == EOF)
			return false;
		for (; c != EOF && c != '\n'; c = getc(ctx->fp)) {
			char ch = (char)c;
			if (b->len < CONFIG_MAX_LINE)
				sb_append(b, &ch, 1);
			else
				*more = true;
		}
		return true;
	}
	if (ctx->text[ctx->pos] == '\0')
		return false;
	for (; ctx->text[ctx->pos] && ctx->text[ctx->pos] != '\n'; ctx->pos++) {
		if (b->len < CONFIG_MAX_LINE)
			sb_append(b, ctx->text + ctx->pos, 1);
		else
			*more = true;
	}
	if (ctx->text[ctx->pos] == '\n')
		ctx->pos++;
	return true;
}

/* A line too long for inih's buffer (Debian builds it with 200 bytes) is
 * handed to inih as "key=" LONG_VALUE_MARK, and its value kept aside for
 * on_entry(), trimmed and with an inline comment cut as inih does; a long
 * comment is handed over as an empty line. */
static bool stash_long_line(struct parse_ctx *ctx, char *line, char *str, int num)
{
	char *eq, *v, *end;
	size_t klen;

	while (*line == ' ' || *line == '\t')
		line++;
	if (*line == ';' || *line == '#') {
		snprintf(str, (size_t)num, "\n");
		return true;
	}
	eq = strchr(line, '=');
	if (eq == NULL || *line == '[' || (klen = (size_t)(eq - line)) + sizeof(LONG_VALUE_MARK) + 2 > (size_t)num)
		return false;
	for (v = eq + 1; *v == ' ' || *v == '\t'; v++)
		;
	for (end = v; *end; end++)
		if (*end == ';' && end > v && (end[-1] == ' ' || end[-1] == '\t'))
			break;
	while (end > v && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r'))
		end--;
	free(ctx->long_value);
	ctx->long_value = text_alloc((size_t)(end - v) + 1);
	memcpy(ctx->long_value, v, (size_t)(end - v));
	ctx->long_value[end - v] = '\0';
	snprintf(str, (size_t)num, "%.*s=%s\n", (int)klen, line, LONG_VALUE_MARK);
	return true;
}

/* fgets() for inih that counts lines and takes lines of up to
 * CONFIG_MAX_LINE characters (longer ones are refused, never split). */
static char *reader(char *str, int num, void *stream)
{
	struct parse_ctx *ctx = stream;
	struct strbuf b;
	bool more;

	if (ctx->failed)
		return NULL;
	free(ctx->long_value);
	ctx->long_value = NULL;
	sb_init(&b, 256);
	if (!next_line(ctx, &b, &more)) {
		free(b.s);
		return NULL;
	}
	ctx->line++;
	if (more) {
		snprintf(ctx->err, ctx->errlen, "%s:%d: line longer than %d characters (the limit)",
		         ctx->cfg->path, ctx->line, CONFIG_MAX_LINE);
		goto fail;
	}
	if (b.len + 2 <= (size_t)num) {
		snprintf(str, (size_t)num, "%s\n", b.s);
	} else if (!stash_long_line(ctx, b.s, str, num)) {
		snprintf(ctx->err, ctx->errlen, "%s:%d: a line longer than %d characters must be "
		         "key = value with a short key", ctx->cfg->path, ctx->line, num - 2);
		goto fail;
	}
	free(b.s);
	return str;
fail:
	free(b.s);
	ctx->failed = true;
	return NULL;
}

static struct config *parse(struct parse_ctx *ctx)
{
	int rc;

	/* Debian's inih reads an indented line as the continuation of the
	 * previous value; an indented key must be a key. */
	ini_allow_multiline = false;
	rc = ini_parse_stream(reader, ctx, on_entry, ctx);
	free(ctx->long_value);
	ctx->long_value = NULL;

	if (!ctx->failed && rc != 0) {
		if (rc > 0)
			snprintf(ctx->err, ctx->errlen, "%s:%d: syntax error (expected [section] or key = value)",
			         ctx->cfg->path, rc);
		else
			snprintf(ctx->err, ctx->errlen, "%s: cannot parse", ctx->cfg->path);
		ctx->failed = true;
	}
	if (ctx->failed) {
		config_free(ctx->cfg);
		return NULL;
	}
	return ctx->cfg;
}

struct config *config_load(const char *path, char *err, size_t errlen)
{
	struct parse_ctx ctx = { .err = err, .errlen = errlen };
	struct config *cfg;
	struct stat st;

	ctx.fp = fopen(path, "r");
	if (ctx.fp == NULL) {
		snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
		return NULL;
	}
	ctx.cfg = text_alloc(sizeof(*ctx.cfg));
	ctx.cfg->path = text_strdup(path);
	ctx.cfg->others_can_read = fstat(fileno(ctx.fp), &st) == 0 && (st.st_mode & S_IROTH);
	cfg = parse(&ctx);
	fclose(ctx.fp);
	return cfg;
}

struct config *config_load_string(const char *name, const char *text, char *err, size_t errlen)
{
	struct parse_ctx ctx = { .err = err, .errlen = errlen, .text = text };

	ctx.cfg = text_alloc(sizeof(*ctx.cfg));
	ctx.cfg->path = text_strdup(name);
	return parse(&ctx);
}
