"""The samples viewer: one static HTML page that browses the sampled rows by iteration.

:func:`page_html` returns a self-contained page (inline CSS and JavaScript, nothing fetched: a
page opened from ``file://`` may not read the files beside it) that embeds each iteration's
records as a ``<script type="application/json" class="lppo-samples">`` block, the iteration
file's JSON lines as one JSON array. The page lists the iterations, shows every sampled row of
the chosen one (prompt, completion, reward, a multi-turn row's turns) and its tokens coloured
by advantage or by mismatch (blue above 0, red below, the iteration's largest magnitude the
fullest colour), the per-token numbers in each token's tooltip. Its state is in the address's
fragment (``#iteration=3&mode=mismatch``), so a link (or a headless browser) opens a given view.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["embedded_iterations", "page_html"]

#: The class of the blocks holding an iteration's records.
DATA_CLASS = "lppo-samples"

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; display: flex; color: #222; }
nav { width: 11em; padding: .5em; border-right: 1px solid #ccc; height: 100vh;
      overflow-y: auto; position: sticky; top: 0; box-sizing: border-box; }
nav a { display: block; padding: .15em .4em; color: #222; text-decoration: none; }
nav a.current { background: #dbe4ff; font-weight: bold; }
main { padding: .5em 1em; flex: 1; min-width: 0; }
.sample { border: 1px solid #ccc; border-radius: 4px; margin: .6em 0; padding: .5em; }
.meta { color: #555; font-size: 12px; }
pre { white-space: pre-wrap; margin: .2em 0; background: #f6f6f6; padding: .3em; }
.tokens { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.9; }
.tok { border-radius: 2px; padding: 1px 0; }
.tok.obs { color: #777; font-style: italic; border-bottom: 1px dotted #999; }
.tok.untrained { text-decoration: line-through; }
.turn { margin: .2em 0; }
.turn b { display: inline-block; width: 7em; }
button.on { background: #dbe4ff; font-weight: bold; }
"""

_SCRIPT = r"""
const runs = Array.from(document.querySelectorAll('script.lppo-samples'))
  .map(b => ({iteration: Number(b.dataset.iteration), rows: JSON.parse(b.textContent)}))
  .sort((a, b) => a.iteration - b.iteration);
const byIteration = new Map(runs.map(r => [r.iteration, r.rows]));
const MODES = {advantage: 'advantage', mismatch: 'mismatch'};

function state() {
  const p = new URLSearchParams(location.hash.slice(1));
  const last = runs.length ? runs[runs.length - 1].iteration : null;
  const it = byIteration.has(Number(p.get('iteration'))) ? Number(p.get('iteration')) : last;
  return {iteration: it, mode: MODES[p.get('mode')] || 'advantage'};
}
function go(change) {
  const s = Object.assign(state(), change);
  location.hash = 'iteration=' + s.iteration + '&mode=' + s.mode;
}
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(v) { return v === null || v === undefined ? 'n/a' : Number(v).toPrecision(4); }
function colour(v, scale) {
  if (v === null || v === undefined || !scale) return '';
  const t = Math.max(-1, Math.min(1, v / scale));
  const rgb = t >= 0 ? '37, 99, 235' : '220, 38, 38';
  return 'rgba(' + rgb + ', ' + Math.abs(t).toFixed(3) + ')';
}
function tooltip(t) {
  const lines = ['token ' + t.id + ' at ' + t.position + (t.policy ? '' : ' (observation)')];
  const names = [['advantage', 'advantage'], ['mismatch', 'mismatch (π_old − μ)'],
    ['gen_logprob', 'μ log-prob (engine)'], ['old_logprob', 'π_old log-prob'],
    ['ref_logprob', 'reference log-prob'], ['teacher_logprob', 'teacher log-prob'],
    ['value', 'value'],
    ['value_target', 'value target'], ['turn_reward', 'turn reward']];
  for (const [k, label] of names) {
    if (t[k] !== null && t[k] !== undefined) lines.push(label + ' ' + fmt(t[k]));
  }
  if (!t.trained && t.policy) lines.push('not trained on');
  return lines.join('\n');
}
function tokenSpan(t, mode, scale) {
  const v = t[mode];
  const kind = 'tok' + (t.policy ? '' : ' obs') + (t.policy && !t.trained ? ' untrained' : '');
  const s = el('span', {class: kind, title: tooltip(t), 'data-position': t.position,
                        'data-value': v === null || v === undefined ? '' : v},
               t.text === '' ? '∅' : t.text.replace(/\n/g, '⏎\n'));
  const c = colour(v, scale);
  if (c) s.style.background = c;
  return s;
}
function sampleCard(row, mode, scale) {
  const card = el('section', {class: 'sample', 'data-row': row.row_id});
  card.append(el('div', {class: 'meta'}, 'row ' + row.row_id + ' · prompt ' + row.prompt_index +
    ' · reward ' + fmt(row.reward) + (row.valid ? '' : ' · invalid (not trained)') +
    ' · mean advantage ' + fmt(row.advantage_mean) +
    ' · max |mismatch| ' + fmt(row.max_abs_mismatch) +
    ' · ' + row.response_tokens + ' policy tokens' +
    (row.observation_tokens ? ', ' + row.observation_tokens + ' observation tokens' : '')));
  card.append(el('div', {}, 'prompt'), el('pre', {class: 'prompt'}, row.prompt));
  card.append(el('div', {}, 'completion'), el('pre', {class: 'completion'}, row.completion));
  for (const turn of row.turns) {
    const d = el('div', {class: 'turn ' + turn.kind});
    d.append(el('b', {}, turn.kind + (turn.reward ? ' (' + fmt(turn.reward) + ')' : '')));
    d.append(document.createTextNode(turn.text));
    card.append(d);
  }
  const tokens = el('div', {class: 'tokens'});
  for (const t of row.tokens) tokens.append(tokenSpan(t, mode, scale));
  if (row.tokens_omitted) {
    tokens.append(el('span', {class: 'meta'}, ' … ' + row.tokens_omitted + ' more tokens'));
  }
  card.append(el('div', {}, 'tokens, coloured by ' + mode), tokens);
  return card;
}
function render() {
  const s = state();
  const nav = document.querySelector('nav'), main = document.querySelector('main');
  nav.replaceChildren(el('div', {class: 'meta'}, runs.length + ' iterations'));
  for (const r of runs) {
    const a = el('a', {href: '#iteration=' + r.iteration + '&mode=' + s.mode,
                       class: r.iteration === s.iteration ? 'current' : '',
                       'data-iteration': r.iteration}, 'iteration ' + r.iteration);
    nav.append(a);
  }
  main.replaceChildren();
  if (s.iteration === null) { main.append(el('p', {}, 'No samples yet.')); return; }
  const rows = byIteration.get(s.iteration);
  const values = rows.flatMap(r => r.tokens.map(t => Math.abs(t[s.mode] ?? 0)));
  const scale = Math.max(0, ...values);
  const bar = el('div', {});
  for (const m of Object.keys(MODES)) {
    const b = el('button', {class: m === s.mode ? 'on' : '', 'data-mode': m}, 'colour by ' + m);
    b.onclick = () => go({mode: m});
    bar.append(b);
  }
  bar.append(el('span', {class: 'meta', id: 'legend'},
    '  blue > 0 > red; full colour at |' + s.mode + '| = ' + fmt(scale)));
  main.append(el('h2', {}, 'iteration ' + s.iteration + ': ' + rows.length + ' samples'), bar);
  for (const row of rows) main.append(sampleCard(row, s.mode, scale));
}
window.addEventListener('hashchange', render);
render();
"""


def _embed(text: str) -> str:
    r"""JSON text safe inside a ``<script>`` element: no ``<``, ``>`` or ``&`` left in it.

    The characters only occur inside JSON strings, where their ``\u`` escapes mean the same.
    """
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def page_html(iterations: Mapping[int, str], title: str = "lppo samples") -> str:
    """The viewer page embedding ``iterations``.

    Args:
        iterations: iteration number -> that iteration file's text (one JSON record a line).
        title: the page's title.
    """
    blocks = []
    for number in sorted(iterations):
        lines = [line for line in iterations[number].splitlines() if line.strip()]
        data = _embed("[" + ",".join(lines) + "]")
        blocks.append(
            f'<script type="application/json" class="{DATA_CLASS}" '
            f'data-iteration="{number}">{data}</script>'
        )
    safe_title = title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{safe_title}</title>",
            f"<style>{_STYLE}</style></head>",
            "<body><nav></nav><main></main>",
            *blocks,
            f"<script>{_SCRIPT}</script>",
            "</body></html>",
            "",
        ]
    )


def embedded_iterations(page: str) -> dict[int, str]:
    """The JSON arrays a page embeds, by iteration number (for tests and tools).

    Args:
        page: the page's HTML, from :func:`page_html`.
    """
    pattern = re.compile(
        rf'<script type="application/json" class="{DATA_CLASS}" '
        r'data-iteration="(\d+)">(.*?)</script>',
        re.S,
    )
    return {int(m.group(1)): m.group(2) for m in pattern.finditer(page)}
