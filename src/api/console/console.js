// stockd console: a single page over the public REST API (docs/API.md, docs/CONSOLE.md).
// Signed in with a tenant API key (tenant view) or the admin token (operator view). It builds
// every element with the DOM API (never innerHTML from data), follows the tenant's event feed
// with long polls, and polls what the feed does not carry, each about once a second.
'use strict';

(function () {
  const TOKEN_KEY = 'stockd.console.token';
  const HOT_WINDOW_MS = 10000;
  const SERIES_POINTS = 180;
  const RECENT_ORDERS = 50;

  // ---------- small helpers ----------

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name.startsWith('on')) el.addEventListener(name.slice(2), value);
      else if (name === 'class') el.className = value;
      // Through the CSSOM: the Content-Security-Policy refuses inline style attributes.
      else if (name === 'style') el.style.cssText = value;
      else el.setAttribute(name, value === true ? '' : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  function svg(tag, attrs, ...children) {
    const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
    for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, String(value));
    for (const child of children.flat()) if (child) el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    return el;
  }

  const fmt = new Intl.NumberFormat('en');
  const num = (n) => (n === null || n === undefined ? '—' : fmt.format(n));
  const when = (iso) => (iso ? new Date(iso).toLocaleTimeString() : '—');
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  // An Idempotency-Key for one user action; crypto.randomUUID needs a secure context, which a
  // console on plain http to another host is not, so it is built from getRandomValues.
  function idempotencyKey() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return 'console-' + Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
  }

  class ApiError extends Error {
    constructor(status, problem) {
      const text = problem && problem.title ? `${problem.title}: ${problem.detail || ''}` : `HTTP ${status}`;
      super(text);
      this.status = status;
      this.problem = problem || {};
      this.code = this.problem.code || null;
      this.retryAfter = null;
    }
    get transient() { return this.status === 0 || this.status === 429 || this.status >= 500; }
  }

  async function api(method, path, { body, headers, raw, token } = {}) {
    const init = { method, headers: Object.assign({ Authorization: 'Bearer ' + (token || session.token) }, headers || {}) };
    if (body !== undefined) {
      if (raw) init.body = body;
      else { init.body = JSON.stringify(body); init.headers['Content-Type'] = 'application/json'; }
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, { title: 'Server unreachable', detail: String(e.message || e) });
    }
    const type = response.headers.get('content-type') || '';
    const data = type.includes('json') ? await response.json().catch(() => null) : await response.text();
    if (!response.ok && !(response.status === 409 && data && data.order_id)) {
      const err = new ApiError(response.status, typeof data === 'object' ? data : null);
      err.retryAfter = Number(response.headers.get('retry-after')) || null;
      throw err;
    }
    return data;
  }

  function problemText(err) {
    if (!(err instanceof ApiError)) return String(err);
    return err.code ? `${err.message} (${err.code})` : err.message;
  }

  // ---------- session and routing ----------

  const session = { token: null, role: null };
  const timers = new Set();
  let followGeneration = 0;

  function every(ms, fn) {
    let stopped = false;
    const tick = async () => {
      if (stopped) return;
      try { await fn(); } catch (e) { setStatus('error: ' + problemText(e), true); }
      if (!stopped) handle.id = setTimeout(tick, ms);
    };
    const handle = { id: null, stop: () => { stopped = true; clearTimeout(handle.id); } };
    timers.add(handle);
    tick();
    return handle;
  }

  function stopTimers() {
    for (const t of timers) t.stop();
    timers.clear();
  }

  function setStatus(text, down) {
    const el = document.getElementById('status');
    el.textContent = text;
    el.classList.toggle('down', !!down);
  }

  const view = () => document.getElementById('view');

  const TENANT_NAV = [['#/', 'Resources'], ['#/orders', 'Orders'], ['#/reconciliation', 'Reconciliation'],
    ['#/plugins', 'Plugins'], ['#/webhooks', 'Webhooks']];
  const OPERATOR_NAV = [['#/', 'Tenants'], ['#/health', 'Health']];

  function renderNav() {
    const nav = document.getElementById('nav');
    nav.replaceChildren();
    if (!session.role) return;
    const current = location.hash.split('/').slice(0, 2).join('/') || '#/';
    for (const [href, label] of session.role === 'tenant' ? TENANT_NAV : OPERATOR_NAV) {
      nav.append(h('a', { href, class: href === current || (href === '#/' && current === '#') ? 'current' : null }, label));
    }
    document.getElementById('who').textContent = session.role === 'tenant' ? 'tenant view' : 'operator view';
    document.getElementById('signout').hidden = false;
  }

  async function signIn(token) {
    // The admin token opens the operator view; anything else must be a tenant's key.
    try {
      await api('GET', '/v1/admin/tenants', { token });
      return 'operator';
    } catch (e) {
      if (e.transient) throw e;
    }
    await api('GET', '/v1/plugin', { token });
    return 'tenant';
  }

  function showSignIn(message) {
    session.token = null; session.role = null;
    sessionStorage.removeItem(TOKEN_KEY);
    stopTimers(); followGeneration++;
    view().replaceChildren();
    renderNav();
    document.getElementById('who').textContent = '';
    document.getElementById('signout').hidden = true;
    document.getElementById('signin').hidden = false;
    document.getElementById('signin-error').textContent = message || '';
    setStatus('signed out');
    document.getElementById('token').focus();
  }

  async function start(token) {
    const role = await signIn(token);
    session.token = token; session.role = role;
    sessionStorage.setItem(TOKEN_KEY, token);
    document.getElementById('signin').hidden = true;
    if (role === 'tenant') follow();
    route();
  }

  function route() {
    if (!session.role) return;
    stopTimers();
    renderNav();
    const [, page, ...rest] = (location.hash || '#/').split('/');
    const arg = rest.length ? decodeURIComponent(rest.join('/')) : null;
    const pages = session.role === 'tenant'
      ? { '': resourcesPage, resource: () => resourcePage(arg), orders: ordersPage, reconciliation: reconciliationPage,
          plugins: pluginsPage, webhooks: webhooksPage }
      : { '': tenantsPage, health: healthPage };
    (pages[page] || pages[''])();
  }

  // ---------- the live event feed (tenant) ----------

  const live = { seq: 0, orders: [], takes: [], listeners: new Set(), lastEventAt: null, connected: false };

  function onEvents(fn) {
    live.listeners.add(fn);
    const handle = { stop: () => live.listeners.delete(fn) };
    timers.add(handle);
    return handle;
  }

  function absorb(events) {
    for (const event of events) {
      live.seq = event.seq;
      if (event.type === 'order.applied' || event.type === 'order.reversed') {
        live.orders.unshift(event);
        if (event.type === 'order.applied') {
          for (const line of event.data.lines || []) {
            if (line.applied > 0) live.takes.push({ at: event.at, resource: line.resource, qty: line.applied });
          }
        }
      }
    }
    live.orders.length = Math.min(live.orders.length, RECENT_ORDERS);
    const cutoff = Date.now() - HOT_WINDOW_MS;
    live.takes = live.takes.filter((t) => t.at >= cutoff);
    if (events.length) live.lastEventAt = Date.now();
    for (const fn of live.listeners) fn(events);
  }

  async function follow() {
    const generation = ++followGeneration;
    Object.assign(live, { seq: 0, orders: [], takes: [], lastEventAt: null });
    let backoff = 1000;
    let first = true;
    while (generation === followGeneration) {
      try {
        const page = first
          ? await api('GET', '/v1/events?newest=true&limit=200')
          : await api('GET', `/v1/events?after=${live.seq}&limit=1000&wait=20`);
        if (generation !== followGeneration) return;
        first = false;
        live.connected = true;
        absorb(page.items);
        live.seq = page.next_after;
        backoff = 1000;
        const ago = live.lastEventAt ? ` · last event ${((Date.now() - live.lastEventAt) / 1000).toFixed(1)} s ago` : '';
        setStatus(`live · following events after #${live.seq}${ago}`);
      } catch (e) {
        if (generation !== followGeneration) return;
        live.connected = false;
        if (e.status === 401) { showSignIn('The key was refused (revoked?). Sign in again.'); return; }
        const wait = e.retryAfter ? e.retryAfter * 1000 : backoff;
        setStatus(`reconnecting in ${Math.round(wait / 1000)} s: ${problemText(e)}`, true);
        await sleep(wait);
        backoff = Math.min(backoff * 2, 10000);
      }
    }
  }

  function hottest(limit) {
    const cutoff = Date.now() - HOT_WINDOW_MS;
    const sums = new Map();
    for (const t of live.takes) if (t.at >= cutoff) sums.set(t.resource, (sums.get(t.resource) || 0) + t.qty);
    return [...sums.entries()].sort((a, b) => b[1] - a[1]).slice(0, limit);
  }

  // ---------- tenant: resources overview ----------

  function stockBar(r) {
    const total = Math.max(r.available + r.reserved + r.consumed, 1);
    const pct = (n) => (100 * n / total).toFixed(2) + '%';
    return h('div', { class: 'bar', role: 'img', 'aria-label': `${r.available} available, ${r.reserved} reserved, ${r.consumed} consumed` },
      h('span', { class: 'a', style: `width:${pct(r.available)}`, title: `available ${num(r.available)}` }),
      h('span', { class: 'r', style: `width:${pct(r.reserved)}`, title: `reserved ${num(r.reserved)}` }),
      h('span', { class: 'c', style: `width:${pct(r.consumed)}`, title: `consumed ${num(r.consumed)}` }));
  }

  function statusPill(r) {
    if (r.status !== 'active') return h('span', { class: 'pill bad' }, r.status);
    if (r.available === 0) return h('span', { class: 'pill bad' }, 'sold out');
    if (r.low_stock !== undefined && r.available <= r.low_stock) return h('span', { class: 'pill warn' }, 'low');
    return h('span', { class: 'pill good' }, 'active');
  }

  const legend = () => h('p', { class: 'legend muted' }, h('span', { class: 'a' }), 'available', h('span', { class: 'r' }), 'reserved', h('span', { class: 'c' }), 'consumed');

  function resourcesPage() {
    const filters = { prefix: '', search: '', status: '', limit: 100 };
    const body = h('tbody');
    const note = h('p', { class: 'muted' });
    const hot = h('ol', { 'data-testid': 'hot-keys' });
    const expiring = h('tbody');
    const recent = h('tbody');

    const prefix = h('input', { id: 'filter-prefix', placeholder: 'key prefix', maxlength: 200, oninput: () => { filters.prefix = prefix.value.trim(); refresh(); } });
    const search = h('input', { id: 'filter-search', placeholder: 'search keys', oninput: () => { filters.search = search.value.trim().toLowerCase(); draw(); } });
    const status = h('select', { id: 'filter-status', onchange: () => { filters.status = status.value; draw(); } },
      h('option', { value: '' }, 'any status'), h('option', { value: 'active' }, 'active'),
      h('option', { value: 'inactive' }, 'inactive'), h('option', { value: 'sold_out' }, 'sold out'));
    const more = h('button', { type: 'button', class: 'quiet', onclick: () => { filters.limit = Math.min(filters.limit + 100, 1000); refresh(); } }, 'Show more');

    view().replaceChildren(
      h('h1', {}, 'Resources'),
      h('div', { class: 'grid' },
        h('section', { class: 'panel wide' },
          h('div', { class: 'toolbar' },
            h('div', {}, h('label', { for: 'filter-prefix' }, 'Prefix'), prefix),
            h('div', {}, h('label', { for: 'filter-search' }, 'Search'), search),
            h('div', {}, h('label', { for: 'filter-status' }, 'Status'), status)),
          legend(),
          h('table', { 'data-testid': 'resources' },
            h('thead', {}, h('tr', {}, ['key', 'kind', 'mode', 'buckets', 'status', 'stock', 'available', 'reserved', 'consumed', 'total']
              .map((c, i) => h('th', { class: i >= 6 || i === 3 ? 'num' : null }, c)))),
            body),
          note, more),
        h('section', { class: 'panel' }, h('h2', {}, 'Hottest keys, last 10 s'), hot),
        h('section', { class: 'panel' }, h('h2', {}, 'Reservations about to expire'),
          h('table', { 'data-testid': 'expiring' }, h('thead', {}, h('tr', {}, h('th', {}, 'reservation'), h('th', {}, 'order'), h('th', {}, 'lines'), h('th', { class: 'num' }, 'expires in'))), expiring)),
        h('section', { class: 'panel wide' }, h('h2', {}, 'Recent orders'), ordersTable(recent))));

    let items = [];
    let drawn = null;
    function draw() {
      const rows = items.filter((r) => (!filters.search || r.key.toLowerCase().includes(filters.search))
        && (!filters.status || (filters.status === 'sold_out' ? r.available === 0 : r.status === filters.status)));
      // Rebuilt only when something shown changed: a row replaced every second would swallow a
      // click that lands while it is being replaced.
      const shown = JSON.stringify([rows, items.length]);
      if (shown === drawn) return;
      drawn = shown;
      body.replaceChildren(...rows.map((r) => h('tr', { 'data-key': r.key },
        h('td', {}, h('a', { href: '#/resource/' + encodeURIComponent(r.key) }, r.key)),
        h('td', {}, r.kind), h('td', {}, r.mode), h('td', { class: 'num' }, r.buckets), h('td', {}, statusPill(r)),
        h('td', {}, stockBar(r)),
        h('td', { class: 'num available' }, num(r.available)), h('td', { class: 'num reserved' }, num(r.reserved)),
        h('td', { class: 'num consumed' }, num(r.consumed)), h('td', { class: 'num total' }, num(r.total)))));
      if (!rows.length) body.append(h('tr', {}, h('td', { colspan: 10, class: 'muted' }, items.length ? 'No resource matches.' : 'No resources yet.')));
    }
    async function refresh() {
      const q = new URLSearchParams({ limit: String(filters.limit) });
      if (filters.prefix) q.set('prefix', filters.prefix);
      const page = await api('GET', '/v1/resources?' + q);
      items = page.items;
      note.textContent = page.next_after ? `Showing the first ${items.length} resources by key.` : `${items.length} resources.`;
      more.hidden = !page.next_after || filters.limit >= 1000;
      draw();
    }
    function drawLive() {
      const top = hottest(10);
      hot.replaceChildren(...top.map(([key, qty]) => h('li', { 'data-key': key },
        h('a', { href: '#/resource/' + encodeURIComponent(key) }, key), ' ', h('span', { class: 'muted' }, `${num(qty)} taken · ${(qty / (HOT_WINDOW_MS / 1000)).toFixed(1)}/s`))));
      if (!top.length) hot.append(h('li', { class: 'muted' }, 'Nothing taken in the last 10 seconds.'));
      drawOrders(recent, 10);
    }
    every(1000, refresh);
    every(2000, async () => {
      const page = await api('GET', '/v1/reservations?limit=20');
      expiring.replaceChildren(...page.items.map((r) => h('tr', { 'data-id': r.id },
        h('td', {}, r.id), h('td', {}, r.order_id), h('td', { class: 'wrap' }, r.lines.map((l) => `${l.resource} ×${l.qty}`).join(', ')),
        h('td', { class: 'num' }, Math.max(0, Math.round((new Date(r.expires_at) - Date.now()) / 1000)) + ' s'))));
      if (!page.items.length) expiring.append(h('tr', {}, h('td', { colspan: 4, class: 'muted' }, 'No held reservations.')));
    });
    every(1000, async () => drawLive());
    onEvents(drawLive);
  }

  function ordersTable(tbody) {
    return h('table', { 'data-testid': 'recent-orders' },
      h('thead', {}, h('tr', {}, h('th', {}, 'time'), h('th', {}, 'order'), h('th', {}, 'event'), h('th', {}, 'status'), h('th', {}, 'lines'))), tbody);
  }

  function drawOrders(tbody, limit) {
    const rows = live.orders.slice(0, limit).map((e) => {
      const d = e.data;
      const status = e.type === 'order.reversed' ? 'reversed' : d.status;
      const cls = status === 'succeeded' ? 'pill good' : status === 'partial' || status === 'reversed' ? 'pill warn' : 'pill bad';
      const lines = (d.lines || []).map((l) => `${l.resource || l.key} ${l.applied !== undefined ? l.applied + '/' + l.qty : '×' + l.qty}${l.reason ? ' (' + l.reason + ')' : ''}`).join(', ');
      return h('tr', { 'data-order': d.order_id }, h('td', {}, when(e.timestamp)), h('td', {}, d.order_id),
        h('td', {}, e.type === 'order.applied' ? d.action : 'reversal'), h('td', {}, h('span', { class: cls }, status)), h('td', { class: 'wrap' }, lines));
    });
    tbody.replaceChildren(...rows);
    if (!rows.length) tbody.append(h('tr', {}, h('td', { colspan: 5, class: 'muted' }, live.connected ? 'No orders in the feed yet.' : 'Connecting to the event feed…')));
  }

  function ordersPage() {
    const tbody = h('tbody');
    const lookup = h('input', { id: 'order-lookup', placeholder: 'order id', maxlength: 128 });
    const found = h('div');
    view().replaceChildren(h('h1', {}, 'Orders'),
      h('section', { class: 'panel' }, h('h2', {}, 'Look up an order'),
        h('form', { class: 'toolbar', onsubmit: async (ev) => {
          ev.preventDefault();
          try {
            const order = await api('GET', '/v1/orders/' + encodeURIComponent(lookup.value.trim()));
            found.replaceChildren(h('pre', {}, JSON.stringify(order, null, 2)));
          } catch (e) { found.replaceChildren(h('p', { class: 'error' }, problemText(e))); }
        } }, lookup, h('button', { type: 'submit' }, 'Look up')), found),
      h('section', { class: 'panel' }, h('h2', {}, 'Recent orders (applied and reversed; refused orders are not events)'), ordersTable(tbody)));
    const draw = () => drawOrders(tbody, RECENT_ORDERS);
    every(1000, async () => draw());
    onEvents(draw);
  }

  // ---------- tenant: one resource ----------

  function resourcePage(key) {
    const series = [];
    const facts = h('dl', { class: 'kv', 'data-testid': 'resource-facts' });
    const bucketTable = h('div');
    const chart = h('div', { 'data-testid': 'sell-through' });
    const ledgerBody = h('tbody');
    const ledgerNote = h('p', { class: 'muted' });
    const adjustMessage = h('p', { role: 'status' });
    const delta = h('input', { id: 'adjust-delta', type: 'number', step: 1, required: true, placeholder: '+50 or -3' });
    const reason = h('input', { id: 'adjust-reason', maxlength: 200, placeholder: 'restock' });
    let pendingKey = idempotencyKey();
    // The newest entries first; or pages forward from the first entry.
    const ledger = { newest: true, cursors: [0], index: 0, limit: 50 };

    view().replaceChildren(
      h('p', {}, h('a', { href: '#/' }, '← Resources')),
      h('h1', {}, key),
      h('div', { class: 'grid' },
        h('section', { class: 'panel' }, h('h2', {}, 'State'), facts, bucketTable),
        h('section', { class: 'panel' }, h('h2', {}, 'Sell-through since this page opened'), chart,
          h('p', { class: 'legend muted' }, h('span', { class: 'a' }), 'available', h('span', { style: 'background:#2c5fb8' }), 'taken per second')),
        h('section', { class: 'panel' }, h('h2', {}, 'Restock or write off'),
          h('form', { class: 'toolbar', onsubmit: async (ev) => {
            ev.preventDefault();
            const body = { delta: Number(delta.value) };
            if (reason.value.trim()) body.reason = reason.value.trim();
            try {
              const state = await api('POST', `/v1/resources/${encodeURIComponent(key)}/adjustments`, { body, headers: { 'Idempotency-Key': pendingKey } });
              adjustMessage.className = '';
              adjustMessage.textContent = `Applied: available ${num(state.available)} of ${num(state.total)}.`;
              pendingKey = idempotencyKey();
            } catch (e) {
              adjustMessage.className = 'error';
              // A transient failure keeps the key: sending again cannot apply it twice.
              adjustMessage.textContent = problemText(e) + (e.transient ? ' — send again to retry safely.' : '');
              if (!e.transient) pendingKey = idempotencyKey();
            }
          } },
          h('div', {}, h('label', { for: 'adjust-delta' }, 'Delta'), delta),
          h('div', {}, h('label', { for: 'adjust-reason' }, 'Reason'), reason),
          h('button', { type: 'submit' }, 'Apply')), adjustMessage),
        h('section', { class: 'panel wide' }, h('h2', {}, 'Ledger'),
          h('div', { class: 'toolbar' },
            h('button', { type: 'button', class: 'quiet', id: 'ledger-newest', onclick: () => { ledger.newest = true; loadLedger(); } }, 'Newest'),
            h('button', { type: 'button', class: 'quiet', id: 'ledger-first', onclick: () => { Object.assign(ledger, { newest: false, index: 0 }); loadLedger(); } }, 'First'),
            h('button', { type: 'button', class: 'quiet', onclick: () => { if (!ledger.newest && ledger.index > 0) { ledger.index--; loadLedger(); } } }, 'Previous'),
            h('button', { type: 'button', class: 'quiet', id: 'ledger-next', onclick: () => { if (!ledger.newest && ledger.cursors[ledger.index + 1] !== undefined) { ledger.index++; loadLedger(); } } }, 'Next')),
          h('table', { 'data-testid': 'ledger' },
            h('thead', {}, h('tr', {}, ['seq', 'time', 'op', 'bucket', 'qty', 'available', 'reserved', 'consumed', 'order', 'plugin']
              .map((c, i) => h('th', { class: [0, 3, 4, 5, 6, 7, 9].includes(i) ? 'num' : null }, c)))),
            ledgerBody), ledgerNote)));

    async function loadLedger() {
      const path = `/v1/resources/${encodeURIComponent(key)}/ledger?limit=${ledger.limit}`;
      const page = await api('GET', ledger.newest ? path + '&newest=true' : `${path}&after=${ledger.cursors[ledger.index]}`);
      if (!ledger.newest) ledger.cursors[ledger.index + 1] = page.next_after === null ? undefined : Number(page.next_after);
      ledgerBody.replaceChildren(...page.items.map((e) => {
        const bucketMove = e.op === 'adjust' && String(e.request_id || '').startsWith('rebalance_');
        return h('tr', { class: `op-${e.op}${bucketMove ? ' op-bucket' : ''}`, 'data-seq': e.seq },
          h('td', { class: 'num' }, e.seq), h('td', {}, when(e.at)), h('td', { class: 'op' }, (bucketMove ? 'bucket move' : e.op) + (e.reverses ? ` of ${e.reverses}` : '')),
          h('td', { class: 'num' }, e.bucket), h('td', { class: 'num' }, num(e.qty)),
          h('td', { class: 'num' }, num(e.available_after)), h('td', { class: 'num' }, num(e.reserved_after)), h('td', { class: 'num' }, num(e.consumed_after)),
          h('td', {}, e.order_id || ''), h('td', { class: 'num' }, e.plugin_version === null ? '' : e.plugin_version));
      }));
      ledgerNote.textContent = ledger.newest ? `The newest ${page.items.length} entries (refreshed every 2 s).`
        : `Page ${ledger.index + 1} from the first entry, ${page.items.length} entries${page.next_after ? '; more after' : '; the newest'}.`;
    }

    async function refresh() {
      const r = await api('GET', '/v1/resources/' + encodeURIComponent(key));
      series.push({ t: Date.now(), available: r.available, taken: r.consumed + r.reserved });
      if (series.length > SERIES_POINTS) series.shift();
      facts.replaceChildren(...[['kind', r.kind], ['mode', r.mode], ['status', r.status], ['buckets', r.buckets],
        ['available', num(r.available)], ['reserved', num(r.reserved)], ['consumed', num(r.consumed)], ['total', num(r.total)],
        ['low stock at', r.low_stock === undefined ? 'not set' : num(r.low_stock)], ['version', r.version], ['updated', when(r.updated_at)]]
        .flatMap(([k, v]) => [h('dt', {}, k), h('dd', { 'data-field': k }, v)]));
      facts.prepend(h('dt', {}, 'stock'), h('dd', {}, stockBar(r)));
      if (r.bucket_counts) {
        const cells = (b) => [b.bucket, num(b.available), num(b.reserved), num(b.consumed)].map((v) => h('td', { class: 'num' }, v));
        bucketTable.replaceChildren(h('h2', {}, 'Buckets'),
          h('table', { 'data-testid': 'buckets' },
            h('thead', {}, h('tr', {}, ['bucket', 'available', 'reserved', 'consumed'].map((c) => h('th', { class: 'num' }, c)))),
            h('tbody', {}, r.bucket_counts.map((b) => h('tr', {}, cells(b))))));
      }
      chart.replaceChildren(sellThrough(series));
    }

    every(1000, async () => {
      try { await refresh(); } catch (e) {
        if (e.status === 404) { view().replaceChildren(h('h1', {}, key), h('p', { class: 'error' }, 'No such resource.')); stopTimers(); return; }
        throw e;
      }
    });
    every(2000, async () => { if (ledger.newest) await loadLedger(); });
  }

  // Available over time and units taken per second, on one SVG (a line each; scales shown).
  function sellThrough(series) {
    const W = 600, H = 180, L = 44, R = 44, T = 10, B = 20;
    const root = svg('svg', { class: 'chart', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'available and units taken per second over time' });
    if (series.length < 2) {
      root.append(svg('text', { x: L, y: H / 2 }, 'collecting samples…'));
      return root;
    }
    const t0 = series[0].t, t1 = series[series.length - 1].t;
    const rates = series.map((p, i) => (i === 0 ? 0 : Math.max(0, (p.taken - series[i - 1].taken) / ((p.t - series[i - 1].t) / 1000))));
    const maxA = Math.max(1, ...series.map((p) => p.available));
    const maxR = Math.max(1, ...rates);
    const x = (t) => L + (W - L - R) * (t - t0) / Math.max(1, t1 - t0);
    const ya = (v) => T + (H - T - B) * (1 - v / maxA);
    const yr = (v) => T + (H - T - B) * (1 - v / maxR);
    root.append(
      svg('line', { x1: L, y1: H - B, x2: W - R, y2: H - B }),
      svg('text', { x: 2, y: T + 8 }, num(maxA)), svg('text', { x: 2, y: H - B }, '0'),
      svg('text', { x: W - R + 4, y: T + 8 }, num(Math.round(maxR)) + '/s'),
      svg('text', { x: L, y: H - 4 }, `${Math.round((t1 - t0) / 1000)} s ago`), svg('text', { x: W - R - 20, y: H - 4 }, 'now'),
      svg('polyline', { class: 'available', points: series.map((p) => `${x(p.t).toFixed(1)},${ya(p.available).toFixed(1)}`).join(' ') }),
      svg('polyline', { class: 'rate', points: series.map((p, i) => `${x(p.t).toFixed(1)},${yr(rates[i]).toFixed(1)}`).join(' ') }));
    return root;
  }

  // ---------- tenant: reconciliation ----------

  function reconciliationPage() {
    const out = h('div');
    const passSelect = h('select', { id: 'reconcile-pass' }, h('option', { value: 'incremental' }, 'incremental'), h('option', { value: 'full' }, 'full'));
    view().replaceChildren(h('h1', {}, 'Reconciliation'),
      h('p', { class: 'muted' }, 'Each resource proven equal to its opening balance plus its ledger; redis-mode resources compared with the database. Runs a pass every 3 seconds while open.'),
      h('div', { class: 'toolbar' }, h('div', {}, h('label', { for: 'reconcile-pass' }, 'Pass'), passSelect)), out);
    const table = (testid, headers, rows, empty) => h('table', { 'data-testid': testid },
      h('thead', {}, h('tr', {}, headers.map((c) => h('th', {}, c)))),
      h('tbody', {}, rows.length ? rows : h('tr', {}, h('td', { colspan: headers.length, class: 'muted' }, empty))));
    const counters = (c) => c ? `${num(c.available)} / ${num(c.reserved)} / ${num(c.consumed)} / ${num(c.total)}` : '—';
    every(3000, async () => {
      const r = await api('GET', '/v1/reconciliation?pass=' + passSelect.value);
      out.replaceChildren(
        h('section', { class: 'panel' }, h('h2', {}, 'Ledger'),
          h('p', {}, h('span', { 'data-testid': 'drift-count', class: r.drift.length ? 'pill bad' : 'pill good' }, r.drift.length ? `${r.drift.length} drifting` : 'no drift'),
            ` · ${num(r.checked)} resources checked · ${num(r.ledger_rows_read)} ledger rows read (${r.pass} pass)`),
          table('drift', ['resource', 'bucket', 'expected (available / reserved / consumed / total)', 'actual'],
            r.drift.map((d) => h('tr', { 'data-key': d.key }, h('td', {}, d.key), h('td', {}, d.bucket ?? ''), h('td', {}, counters(d.expected)), h('td', { class: 'error' }, counters(d.actual)))), 'Every resource matches its ledger.')),
        h('section', { class: 'panel' }, h('h2', {}, 'Redis vs database'),
          h('p', {}, r.redis_reachable ? '' : h('span', { class: 'pill bad' }, 'Redis unreachable')),
          table('redis', ['resource', 'warmed', 'redis', 'backlog', 'unsettled', 'database', 'drift'],
            r.redis.map((x) => h('tr', { 'data-key': x.key }, h('td', {}, x.key), h('td', {}, x.warmed ? 'yes' : 'no'), h('td', {}, num(x.redis_available)),
              h('td', {}, num(x.backlog)), h('td', {}, num(x.unsettled)), h('td', {}, num(x.database_available)), h('td', { class: x.drift ? 'error' : '' }, num(x.drift)))), 'No redis-mode resources.')),
        h('section', { class: 'panel' }, h('h2', {}, 'Settlement failures'),
          table('settlement-failures', ['time', 'resource', 'order', 'qty', 'reason'],
            r.settlement_failures.map((f) => h('tr', {}, h('td', {}, when(f.at)), h('td', {}, f.key), h('td', {}, f.order_id || ''), h('td', {}, num(f.qty)), h('td', {}, f.reason))), 'None.')),
        h('section', { class: 'panel' }, h('h2', {}, 'Dead letters'),
          table('dead-letters', ['time', 'resource', 'entry', 'reason'],
            r.dead_letters.map((d) => h('tr', {}, h('td', {}, when(d.at)), h('td', {}, d.key), h('td', {}, d.entry_id), h('td', {}, d.reason))), 'None.')));
    });
  }

  // ---------- tenant: plugins and the dry-run playground ----------

  function pluginsPage() {
    const active = h('p', { 'data-testid': 'active-plugin' });
    const versions = h('tbody');
    const message = h('p', { role: 'status' });
    const file = h('input', { id: 'plugin-file', type: 'file', accept: '.wasm,application/wasm' });
    const config = h('input', { id: 'plugin-config', maxlength: 4096, placeholder: 'configuration text (optional)' });
    const order = h('textarea', { id: 'dryrun-body', rows: 10, spellcheck: 'false' });
    const result = h('div', { 'data-testid': 'dryrun-result' });
    let ranOnce = false;

    order.value = JSON.stringify({ order_id: 'console-dry-run', user_id: 'u-1', action: 'deduct', lines: [{ key: 'sku-1', qty: 1 }] }, null, 2);
    api('GET', '/v1/resources?limit=1').then((page) => {
      if (page.items.length && !ranOnce && order.value.includes('"sku-1"')) order.value = order.value.replace('"sku-1"', JSON.stringify(page.items[0].key));
    }).catch(() => {});

    view().replaceChildren(h('h1', {}, 'Plugins'),
      h('div', { class: 'grid' },
        h('section', { class: 'panel' }, h('h2', {}, 'Versions'), active,
          h('table', { 'data-testid': 'plugin-versions' }, h('thead', {}, h('tr', {}, h('th', { class: 'num' }, 'version'), h('th', {}, 'sha256'), h('th', {}, 'uploaded'), h('th', {}, ''))), versions),
          message),
        h('section', { class: 'panel' }, h('h2', {}, 'Upload a version'),
          h('p', { class: 'muted' }, 'A WebAssembly component exporting the planner world (plugins/README.md); it becomes active at once.'),
          h('form', { class: 'toolbar', onsubmit: async (ev) => {
            ev.preventDefault();
            if (!file.files.length) return;
            const q = config.value ? '?config=' + encodeURIComponent(config.value) : '';
            message.textContent = 'Uploading and compiling…';
            try {
              const up = await api('PUT', '/v1/plugin' + q, { body: await file.files[0].arrayBuffer(), raw: true, headers: { 'Content-Type': 'application/wasm' } });
              message.className = ''; message.textContent = `Version ${up.version} is active.`;
            } catch (e) { message.className = 'error'; message.textContent = problemText(e); }
            await load();
          } }, file, config, h('button', { type: 'submit' }, 'Upload'))),
        h('section', { class: 'panel wide' }, h('h2', {}, 'Dry run'),
          h('p', { class: 'muted' }, 'Plans the order with the active version and judges it against the stock now; nothing is applied or recorded.'),
          order, h('p', {}, h('button', { id: 'dryrun-run', type: 'button', onclick: dryRun }, 'Dry run')), result)));

    async function load() {
      const [current, list] = await Promise.all([api('GET', '/v1/plugin'), api('GET', '/v1/plugin/versions')]);
      active.textContent = current.version === 0 ? 'Active: the built-in default plan (version 0).' : `Active: version ${current.version} (sha256 ${current.sha256.slice(0, 12)}…).`;
      active.dataset.version = current.version;
      const rows = [{ version: 0, sha256: null, uploaded_at: null, active: current.version === 0 }, ...list.items];
      versions.replaceChildren(...rows.map((v) => h('tr', { 'data-version': v.version },
        h('td', { class: 'num' }, v.version === 0 ? '0 (built-in)' : v.version), h('td', {}, v.sha256 ? v.sha256.slice(0, 16) + '…' : '—'), h('td', {}, when(v.uploaded_at)),
        h('td', {}, v.active ? h('span', { class: 'pill good' }, 'active') : h('button', { type: 'button', class: 'quiet', 'data-activate': v.version, onclick: () => activate(v.version) }, 'Activate')))));
    }

    async function activate(version) {
      message.textContent = `Activating version ${version}…`;
      try {
        await api('POST', `/v1/plugin/versions/${version}/activate`);
        message.className = ''; message.textContent = `Version ${version} is active.`;
      } catch (e) { message.className = 'error'; message.textContent = problemText(e); }
      await load();
      if (ranOnce) await dryRun();
    }

    async function dryRun() {
      let body;
      try { body = JSON.parse(order.value); } catch (e) { result.replaceChildren(h('p', { class: 'error' }, 'Not JSON: ' + e.message)); return; }
      ranOnce = true;
      try {
        const r = await api('POST', '/v1/orders/dry-run', { body });
        result.replaceChildren(
          h('p', {}, `Planned by ${r.plan.planner.name} version ${r.plan.planner.version}, policy ${r.plan.policy}; outcome `, h('strong', { 'data-testid': 'dryrun-status' }, r.outcome.status), '.'),
          h('table', { 'data-testid': 'dryrun-plan' },
            h('thead', {}, h('tr', {}, ['line', 'qty', 'targets', 'limit', 'outcome'].map((c) => h('th', {}, c)))),
            h('tbody', {}, r.plan.lines.map((l, i) => {
              const o = r.outcome.lines[i] || {};
              return h('tr', {}, h('td', {}, l.line), h('td', { class: 'num' }, l.qty),
                h('td', { class: 'wrap targets' }, l.targets.map((t) => `${t.resource} (${t.kind}${t.create_if_missing ? ', created if missing' : ''})`).join(' → ')),
                h('td', {}, l.limit ? `${l.limit.key} ≤ ${l.limit.max}` : ''), h('td', {}, `${o.status || ''}${o.reason ? ' (' + o.reason + ')' : ''}`));
            }))),
          h('details', {}, h('summary', {}, 'JSON'), h('pre', {}, JSON.stringify(r, null, 2))));
      } catch (e) { result.replaceChildren(h('p', { class: 'error' }, problemText(e))); }
    }

    load().catch((e) => { message.className = 'error'; message.textContent = problemText(e); });
  }

  // ---------- tenant: webhooks ----------

  function webhooksPage() {
    const list = h('div');
    // What the last action on each endpoint answered: kept across the page's refreshes.
    const notes = new Map();
    view().replaceChildren(h('h1', {}, 'Webhooks'), list);
    every(5000, async () => {
      const page = await api('GET', '/v1/webhooks');
      if (!page.items.length) { list.replaceChildren(h('p', { class: 'muted' }, 'No endpoints. Create one with POST /v1/webhooks (docs/WEBHOOKS.md).')); return; }
      const sections = await Promise.all(page.items.map(async (w) => {
        const [detail, deliveries] = await Promise.all([
          api('GET', '/v1/webhooks/' + encodeURIComponent(w.id)),
          api('GET', `/v1/webhooks/${encodeURIComponent(w.id)}/deliveries?limit=20`)]);
        const message = h('span', { role: 'status' }, notes.get(w.id) || '');
        const note = (text) => { notes.set(w.id, text); message.textContent = text; };
        return h('section', { class: 'panel', 'data-webhook': w.id },
          h('h2', {}, w.url),
          h('p', {}, h('span', { class: detail.state === 'active' ? 'pill good' : 'pill bad' }, detail.state || 'active'),
            ` · ${num(detail.pending)} pending · types: ${(w.types && w.types.length) ? w.types.join(', ') : 'all'} `,
            h('button', { type: 'button', class: 'quiet', onclick: async () => {
              try { const r = await api('POST', `/v1/webhooks/${encodeURIComponent(w.id)}/redeliver`, { body: {} }); note(` ${r.queued} queued.`); } catch (e) { note(' ' + problemText(e)); }
            } }, 'Retry now'), message),
          h('table', {}, h('thead', {}, h('tr', {}, ['time', 'event', 'type', 'attempt', 'outcome', 'HTTP', 'error', 'ms'].map((c) => h('th', {}, c)))),
            h('tbody', {}, deliveries.items.length ? deliveries.items.map((d) => h('tr', {},
              h('td', {}, when(d.at)), h('td', {}, '#' + d.seq), h('td', {}, d.type), h('td', {}, d.attempt),
              h('td', {}, h('span', { class: d.outcome === 'delivered' ? 'pill good' : 'pill bad' }, d.outcome)), h('td', {}, d.http_status ?? ''), h('td', {}, d.error ?? ''), h('td', {}, d.latency_ms ?? '')))
              : h('tr', {}, h('td', { colspan: 8, class: 'muted' }, 'No delivery attempts yet.')))));
      }));
      list.replaceChildren(...sections);
    });
  }

  // ---------- operator: tenants, keys, health ----------

  function tenantsPage() {
    const body = h('tbody');
    const message = h('div', { role: 'status' });
    const id = h('input', { id: 'tenant-id', required: true, pattern: '[a-z0-9\\-]{1,64}', maxlength: 64, placeholder: 'acme' });
    const name = h('input', { id: 'tenant-name', required: true, maxlength: 200, placeholder: 'Acme' });
    const keys = h('div', { 'data-testid': 'api-keys' }, h('p', { class: 'muted' }, 'Choose Keys on a tenant to list its API keys.'));
    const shown = (title, text) => message.replaceChildren(h('p', {}, title), h('p', { class: 'secret', 'data-testid': 'new-secret' }, text), h('p', { class: 'muted' }, 'Shown once: stockd keeps only its hash.'));
    const failed = (e) => message.replaceChildren(h('p', { class: 'error' }, problemText(e)));

    view().replaceChildren(h('h1', {}, 'Tenants'),
      h('div', { class: 'grid' },
        h('section', { class: 'panel wide' },
          h('table', { 'data-testid': 'tenants' }, h('thead', {}, h('tr', {}, ['id', 'name', 'created', 'rate limit', ''].map((c) => h('th', {}, c)))), body), message),
        h('section', { class: 'panel' }, h('h2', {}, 'New tenant'),
          h('form', { class: 'toolbar', onsubmit: async (ev) => {
            ev.preventDefault();
            try { const t = await api('POST', '/v1/admin/tenants', { body: { id: id.value.trim(), name: name.value.trim() } }); shown(`Tenant ${t.id} created. Its API key:`, t.api_key); await load(); } catch (e) { failed(e); }
          } }, h('div', {}, h('label', { for: 'tenant-id' }, 'Id'), id), h('div', {}, h('label', { for: 'tenant-name' }, 'Name'), name), h('button', { type: 'submit' }, 'Create'))),
        h('section', { class: 'panel' }, h('h2', {}, 'API keys'), keys)));

    // A tenant's keys (ids and dates; stockd keeps no key, only its hash), each revocable.
    async function showKeys(tenant) {
      const list = await api('GET', `/v1/admin/tenants/${encodeURIComponent(tenant)}/api-keys`);
      keys.replaceChildren(h('p', {}, `Tenant ${tenant}:`), h('table', { 'data-tenant': tenant },
        h('thead', {}, h('tr', {}, ['key id', 'created', 'state', ''].map((c) => h('th', {}, c)))),
        h('tbody', {}, list.items.map((k) => h('tr', { 'data-key-id': k.key_id },
          h('td', {}, k.key_id), h('td', {}, when(k.created_at)),
          h('td', {}, k.revoked_at ? h('span', { class: 'pill bad' }, 'revoked ' + when(k.revoked_at)) : h('span', { class: 'pill good' }, 'active')),
          h('td', {}, k.revoked_at ? '' : h('button', { type: 'button', class: 'quiet', 'data-revoke': k.key_id, onclick: async () => {
            if (!confirm(`Revoke key ${k.key_id} of ${tenant}? Requests with it fail at once.`)) return;
            try { await api('DELETE', `/v1/admin/tenants/${encodeURIComponent(tenant)}/api-keys/${encodeURIComponent(k.key_id)}`); } catch (e) { failed(e); }
            await showKeys(tenant);
          } }, 'Revoke')))))));
    }

    async function load() {
      const page = await api('GET', '/v1/admin/tenants');
      body.replaceChildren(...page.items.map((t) => h('tr', { 'data-tenant': t.id },
        h('td', {}, t.id), h('td', {}, t.name), h('td', {}, when(t.created_at)),
        h('td', {}, t.rate_limit ? `${num(t.rate_limit.requests_per_second)}/s, burst ${num(t.rate_limit.burst)}` : 'server default'),
        h('td', {}, h('button', { type: 'button', class: 'quiet', onclick: async () => {
          try { const k = await api('POST', `/v1/admin/tenants/${encodeURIComponent(t.id)}/api-keys`, { body: {} }); shown(`New key ${k.key_id} for ${t.id}:`, k.api_key); await showKeys(t.id); } catch (e) { failed(e); }
        } }, 'New API key'), ' ',
        h('button', { type: 'button', class: 'quiet', 'data-keys': t.id, onclick: () => showKeys(t.id).catch(failed) }, 'Keys')))));
      if (!page.items.length) body.append(h('tr', {}, h('td', { colspan: 5, class: 'muted' }, 'No tenants yet.')));
    }
    every(5000, load);
  }

  function healthPage() {
    const out = h('div');
    view().replaceChildren(h('h1', {}, 'Health'), out);
    every(2000, async () => {
      let ready;
      try { ready = await api('GET', '/readyz'); } catch (e) { ready = { status: problemText(e), jobs: e.problem.jobs || {} }; }
      let metrics = '';
      try { metrics = await api('GET', '/metrics'); } catch (e) { metrics = ''; }
      const pick = (name) => String(metrics).split('\n').filter((l) => l.startsWith(name) && !l.startsWith('#'))
        .reduce((sum, l) => sum + (Number(l.trim().split(/\s+/).pop()) || 0), 0);
      out.replaceChildren(
        h('section', { class: 'panel' }, h('h2', {}, 'Readiness'),
          h('p', {}, h('span', { 'data-testid': 'readiness', class: ready.status === 'ready' ? 'pill good' : 'pill bad' }, ready.status)),
          h('table', {}, h('thead', {}, h('tr', {}, ['job', 'last ok', 'restarts', 'stuck'].map((c) => h('th', {}, c)))),
            h('tbody', {}, Object.entries(ready.jobs || {}).map(([name, j]) => h('tr', {}, h('td', {}, name),
              h('td', {}, j.last_ok_ms_ago === null ? 'not yet' : `${(j.last_ok_ms_ago / 1000).toFixed(1)} s ago`), h('td', {}, j.restarts),
              h('td', {}, h('span', { class: j.stuck ? 'pill bad' : 'pill good' }, j.stuck ? 'stuck' : 'ok'))))))),
        h('section', { class: 'panel' }, h('h2', {}, 'This process'),
          metrics ? h('dl', { class: 'kv' }, [
            ['requests served', pick('stockd_http_requests_total')], ['requests in flight', pick('stockd_http_requests_in_flight')],
            ['requests shed', pick('stockd_http_shed_total')], ['rate limited', pick('stockd_rate_limited_total')],
            ['event polls waiting', pick('stockd_event_polls_waiting')], ['panics', pick('stockd_panics_total')]]
            .flatMap(([k, v]) => [h('dt', {}, k), h('dd', {}, num(v))])) : h('p', { class: 'muted' }, 'Metrics are not exported by this process.')));
    });
  }

  // ---------- wiring ----------

  document.getElementById('signin-form').addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const token = document.getElementById('token').value.trim();
    const button = document.getElementById('signin-button');
    button.disabled = true;
    try {
      await start(token);
      document.getElementById('token').value = '';
    } catch (e) {
      document.getElementById('signin-error').textContent = e.status === 401 || e.status === 403
        ? 'Neither a tenant API key nor the admin token.' : problemText(e);
    } finally { button.disabled = false; }
  });
  document.getElementById('signout').addEventListener('click', () => showSignIn(''));
  window.addEventListener('hashchange', route);

  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (saved) start(saved).catch(() => showSignIn('Sign in again.'));
  else showSignIn('');
})();
