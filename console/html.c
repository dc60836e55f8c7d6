/* SPDX-License-Identifier: ISC */
/*
 * html.c: escaping for HTML and URLs, the page frame (navigation, the
 * banner's place) and the static stylesheet and script.  No inline script
 * or style anywhere: the Content-Security-Policy (main.c) allows only
 * /static/ files of this origin.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "console.h"
#include "util.h"

void h(struct strbuf *b, const char *s)
{
	struct strbuf t;
	const char *p;

	if (s == NULL)
		return;
	sb_init(&t, strlen(s) + 8);
	/* Producer text first loses what a terminal or a reader would be
	 * misled by (control, invisible and bidi characters, as \uNNNN). */
	sb_term_escape(&t, s, false);
	for (p = t.s; *p; p++) {
		switch (*p) {
		case '&': sb_puts(b, "&amp;"); break;
		case '<': sb_puts(b, "&lt;"); break;
		case '>': sb_puts(b, "&gt;"); break;
		case '"': sb_puts(b, "&quot;"); break;
		case '\'': sb_puts(b, "&#39;"); break;
		default: sb_append(b, p, 1);
		}
	}
	free(t.s);
}

void hq(struct strbuf *b, const char *s)
{
	static const char hex[] = "0123456789ABCDEF";

	for (; s && *s; s++) {
		unsigned char c = (unsigned char)*s;
		if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		    c == '-' || c == '_' || c == '.' || c == '~') {
			sb_append(b, s, 1);
		} else {
			char e[3] = { '%', hex[c >> 4], hex[c & 15] };
			sb_append(b, e, 3);
		}
	}
}

static const struct {
	const char *path, *label;
} nav[] = {
	{ "/", "overview" }, { "/effects", "effects" }, { "/unknown", "unknown" },
	{ "/approvals", "approvals" }, { "/controls", "controls" }, { "/runs", "runs" },
	{ "/audit", "audit" },
};

void page_begin(struct strbuf *b, const struct req *r, const char *title, const char *current)
{
	sb_puts(b, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
	           "<meta name=\"viewport\" content=\"width=device-width\">");
	sb_printf(b, "<meta name=\"refresh-seconds\" content=\"%ld\">", console.refresh_seconds);
	sb_puts(b, "<title>");
	h(b, title);
	sb_puts(b, " - outbox console</title><link rel=\"stylesheet\" href=\"/static/console.css\">"
	           "<link rel=\"icon\" href=\"/static/favicon.svg\" type=\"image/svg+xml\">"
	           "<script src=\"/static/console.js\" defer></script></head><body><nav>"
	           "<span class=\"brand\">outbox console</span>");
	for (size_t i = 0; i < sizeof(nav) / sizeof(nav[0]); i++)
		sb_printf(b, "<a href=\"%s\"%s>%s</a>", nav[i].path,
		          strcmp(nav[i].path, current) == 0 ? " class=\"here\"" : "", nav[i].label);
	sb_puts(b, "<span class=\"who\">");
	if (r->identity) {
		sb_puts(b, "signed in as ");
		h(b, r->identity);
	} else {
		sb_puts(b, "no identity from a trusted proxy");
	}
	sb_puts(b, console.actions ? " &middot; actions on" : " &middot; read-only");
	sb_puts(b, "</span></nav><main>");
}

void page_end(struct strbuf *b)
{
	sb_puts(b, "</main></body></html>\n");
}

const char console_css[] =
	"body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}"
	"nav{background:#1f2937;padding:8px 16px;display:flex;gap:14px;align-items:center}"
	"nav a{color:#d1d5db;text-decoration:none}nav a.here{color:#fff;font-weight:600}"
	"nav .brand{color:#fff;font-weight:700;margin-right:12px}nav .who{margin-left:auto;color:#9ca3af}"
	"main{padding:12px 16px}table{border-collapse:collapse;background:#fff;margin:8px 0}"
	"th,td{border:1px solid #e5e7eb;padding:4px 8px;text-align:left;vertical-align:top}"
	"th{background:#f3f4f6}code,.mono{font-family:ui-monospace,monospace;font-size:12px}"
	".banner{padding:8px 12px;margin-bottom:10px;border-radius:4px;background:#e8f5e9}"
	".banner.off{background:#fdecea;font-weight:600}.banner ul{margin:4px 0}"
	".state-unknown{color:#b45309;font-weight:600}.state-failed{color:#b91c1c}"
	".state-completed{color:#15803d}.state-sending{color:#1d4ed8}"
	"form.inline{display:inline}fieldset{border:1px solid #d1d5db;background:#fff;margin:8px 0}"
	".msg{padding:8px;background:#fff7d6;border:1px solid #f0d98c}.err{background:#fdecea}"
	"svg{background:#fff;border:1px solid #e5e7eb}";

/* Refreshes the page every refresh-seconds while it is visible and no form
 * on it is being filled in; the pages work without it. */
const char console_js[] =
	"(function(){\n"
	"  var m = document.querySelector('meta[name=\"refresh-seconds\"]');\n"
	"  var s = m ? parseInt(m.getAttribute('content'), 10) : 0;\n"
	"  if (!s || document.querySelector('[data-no-refresh]')) return;\n"
	"  var touched = false;\n"
	"  document.addEventListener('input', function(){ touched = true; });\n"
	"  document.addEventListener('change', function(){ touched = true; });\n"
	"  setInterval(function(){\n"
	"    if (document.visibilityState === 'visible' && !touched) location.reload();\n"
	"  }, s * 1000);\n"
	"})();\n";

const char console_icon[] =
	"<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 16 16\">"
	"<rect width=\"16\" height=\"16\" rx=\"3\" fill=\"#1f2937\"/>"
	"<path d=\"M4 8h8M9 5l3 3-3 3\" stroke=\"#fff\" stroke-width=\"2\" fill=\"none\"/></svg>";
