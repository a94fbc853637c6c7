// The console in a real browser: Playwright (playwright-core) driving Debian's Chromium headless
// against a real stockd. Run by tests/api/console.rs, which starts the server, creates the tenant,
// its resource and a plugin version, and answers this script's requests for what only the test
// can do (forcing drift behind the server's back) over stdin/stdout, one line each.
//
// Environment: STOCKD_URL, STOCKD_API_KEY, STOCKD_ADMIN_TOKEN, STOCKD_TENANT, STOCKD_RESOURCE,
// STOCKD_PLUGIN_VERSION (the uploaded, active version), STOCKD_ARTIFACTS (screenshots),
// CHROMIUM (default /usr/bin/chromium).
import { chromium } from 'playwright-core';
import { createInterface } from 'node:readline';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};
const base = env('STOCKD_URL');
const apiKey = env('STOCKD_API_KEY');
const adminToken = env('STOCKD_ADMIN_TOKEN');
const tenant = env('STOCKD_TENANT');
const resource = env('STOCKD_RESOURCE');
const pluginVersion = env('STOCKD_PLUGIN_VERSION');
const artifacts = env('STOCKD_ARTIFACTS');
mkdirSync(artifacts, { recursive: true });

const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
async function ask(request) {
  process.stdout.write(`ASK ${request}\n`);
  const answer = await lines.next();
  if (answer.done || answer.value !== 'ok') throw new Error(`the test did not do "${request}": ${answer.value}`);
}

const step = (name) => process.stdout.write(`STEP ${name}\n`);
const DEADLINE_MS = 15000;

// Waits for `read()` to return a truthy value, polling; fails with `what` after the deadline.
async function until(what, read, deadlineMs = DEADLINE_MS) {
  const end = Date.now() + deadlineMs;
  let last;
  while (Date.now() < end) {
    try { last = await read(); } catch (e) { last = e; }
    if (last && !(last instanceof Error)) return last;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`timed out waiting for ${what} (last: ${last})`);
}

let orderNo = 0;
async function order(action, qty, extra = {}) {
  orderNo += 1;
  const response = await fetch(`${base}/v1/orders`, {
    method: 'POST',
    headers: { Authorization: `Bearer ${apiKey}`, 'Content-Type': 'application/json', 'Idempotency-Key': `console-test-${process.pid}-${orderNo}` },
    body: JSON.stringify({ order_id: `ord-${orderNo}`, user_id: `user-${orderNo}`, action, lines: [{ key: resource, qty }], ...extra }),
  });
  if (response.status !== 201) throw new Error(`order answered ${response.status}: ${await response.text()}`);
  return response.json();
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  headless: true,
  // This machine's network is closed: no background connections, no sandbox as root.
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'],
});
const failures = [];
try {
  const context = await browser.newContext({ viewport: { width: 1366, height: 900 } });
  const page = await context.newPage();
  // Everything the console loads or calls is this server: no CDN, no other origin.
  page.on('request', (r) => { if (!r.url().startsWith(base) && !r.url().startsWith('data:')) failures.push(`request to another origin: ${r.url()}`); });
  // A CSP violation or a script error shows up here.
  page.on('console', (m) => { if (m.type() === 'error' && !/status of (4\d\d|503)/.test(m.text())) failures.push(`console error: ${m.text()}`); });
  page.on('pageerror', (e) => failures.push(`page error: ${e.message}`));

  step('a wrong key is refused on the sign-in form');
  await page.goto(`${base}/console`);
  await page.fill('#token', 'not-a-key');
  await page.click('#signin-button');
  await until('the refusal', async () => (await page.textContent('#signin-error')).includes('Neither'));

  step('the tenant signs in and sees its resource with its counters');
  await page.fill('#token', apiKey);
  await page.click('#signin-button');
  const row = page.locator(`table[data-testid=resources] tr[data-key="${resource}"]`);
  await row.waitFor({ timeout: DEADLINE_MS });
  const available = async () => Number((await row.locator('td.available').textContent()).replace(/,/g, ''));
  const first = await available();
  const pill = async (key) => (await page.textContent(`table[data-testid=resources] tr[data-key="${key}"] .pill`)).trim();
  await until('each state named', async () => (await pill('sku-sold-out')) === 'sold out' && (await pill('coupon-spring')) === 'low'
    && (await pill('wallet-eur')) === 'inactive' && (await pill(resource)) === 'active');
  await page.selectOption('#filter-status', 'sold_out');
  await until('the status filter', async () => (await page.locator('table[data-testid=resources] tr[data-key]').count()) === 1);
  await page.selectOption('#filter-status', '');
  await page.fill('#filter-prefix', 'flash');
  await until('the prefix filter', async () => (await page.locator('table[data-testid=resources] tr[data-key]').count()) === 1);
  await page.fill('#filter-prefix', '');

  step('available falls live while a load runs, and the key is the hottest');
  let loading = true;
  let placed = 0;
  const load = (async () => { while (loading) { await order('deduct', 1); placed += 1; await new Promise((r) => setTimeout(r, 20)); } })();
  const seen = [first];
  await until('available to fall twice on screen', async () => {
    const now = await available();
    if (now < seen[seen.length - 1]) seen.push(now);
    return seen.length >= 3;
  });
  await page.locator(`[data-testid=hot-keys] li[data-key="${resource}"]`).waitFor({ timeout: DEADLINE_MS });
  await page.locator('[data-testid=recent-orders] tbody tr[data-order]').first().waitFor({ timeout: DEADLINE_MS });
  await page.screenshot({ path: join(artifacts, 'resources.png') });
  loading = false;
  await load;
  const consumed = (await (await fetch(`${base}/v1/resources/${resource}`, { headers: { Authorization: `Bearer ${apiKey}` } })).json()).consumed;
  await until('the final counters on screen', async () => (await available()) === first - placed && consumed === placed);

  step('a held reservation is listed as about to expire');
  const reserved = await order('reserve', 1, { ttl_seconds: 600 });
  await page.locator(`[data-testid=expiring] tr[data-id="${reserved.reservation_id}"]`).waitFor({ timeout: DEADLINE_MS });

  step('one resource: state, chart, ledger');
  await page.click(`table[data-testid=resources] tr[data-key="${resource}"] a`);
  await page.locator('[data-testid=sell-through] polyline.available').waitFor({ state: 'attached', timeout: DEADLINE_MS });
  await until('the ledger to show the sale', async () => (await page.locator('[data-testid=ledger] tr.op-deduct').count()) > 0);
  await until('the ledger to show the reservation', async () => (await page.locator('[data-testid=ledger] tr.op-reserve').count()) === 1);
  await page.screenshot({ path: join(artifacts, 'resource.png'), fullPage: true });

  step('a restock from the console, with an Idempotency-Key, shows at once');
  await page.fill('#adjust-delta', '50');
  await page.fill('#adjust-reason', 'console restock');
  await page.click('form button:has-text("Apply")');
  await until('the restock to be applied', async () => (await page.textContent('[role=status]')).includes('Applied'));

  step('activating another plugin version changes the dry run');
  await page.goto(`${base}/console/#/plugins`);
  await page.locator('[data-testid=active-plugin]').getByText(`version ${pluginVersion}`).waitFor({ timeout: DEADLINE_MS });
  await page.fill('#dryrun-body', JSON.stringify({ order_id: 'dry-1', user_id: 'u-1', action: 'deduct', lines: [{ key: resource, qty: 1 }] }));
  await page.click('#dryrun-run');
  // The flash-sale plugin limits each user to one piece per SKU.
  await until('the flash-sale plan', async () => (await page.textContent('[data-testid=dryrun-plan]')).includes(`flash:${resource}:u-1`));
  await page.screenshot({ path: join(artifacts, 'plugins-flash-sale.png'), fullPage: true });
  await page.click('button[data-activate="0"]');
  await until('the built-in plan', async () => {
    const text = await page.textContent('[data-testid=dryrun-result]');
    return text.includes('default version 0') && !text.includes(`flash:${resource}:u-1`);
  });
  await page.locator('[data-testid=active-plugin]').getByText('built-in default').waitFor({ timeout: DEADLINE_MS });
  await page.screenshot({ path: join(artifacts, 'plugins-default.png'), fullPage: true });

  step('reconciliation is clean, then shows a drift forced behind the server\'s back');
  await page.goto(`${base}/console/#/reconciliation`);
  await until('a clean pass', async () => (await page.textContent('[data-testid=drift-count]')) === 'no drift');
  await ask(`drift ${resource}`);
  await page.locator(`[data-testid=drift] tr[data-key="${resource}"]`).waitFor({ timeout: DEADLINE_MS });
  await until('the drift count', async () => (await page.textContent('[data-testid=drift-count]')) === '1 drifting');
  await page.screenshot({ path: join(artifacts, 'reconciliation.png'), fullPage: true });

  step('the webhook endpoint shows its failed attempts, and a retry can be asked for');
  await page.goto(`${base}/console/#/webhooks`);
  const hook = page.locator('[data-webhook]');
  await until('a failed attempt', async () => (await hook.locator('tbody').textContent()).includes('connect'));
  await hook.locator('button:has-text("Retry now")').click();
  await until('the retry queued', async () => /\d+ queued/.test(await hook.locator('[role=status]').textContent()));
  await page.screenshot({ path: join(artifacts, 'webhooks.png'), fullPage: true });

  step('signing out forgets the key');
  await page.click('#signout');
  await page.locator('#signin').waitFor({ state: 'visible' });
  await page.reload();
  await page.locator('#signin').waitFor({ state: 'visible' });

  step('the operator signs in with the admin token: tenants, a new tenant, health');
  await page.fill('#token', adminToken);
  await page.click('#signin-button');
  await page.locator(`table[data-testid=tenants] tr[data-tenant="${tenant}"]`).waitFor({ timeout: DEADLINE_MS });
  const made = `console-made-${process.pid}`;
  await page.fill('#tenant-id', made);
  await page.fill('#tenant-name', 'Made in the console');
  await page.click('form button:has-text("Create")');
  const secret = await page.locator('[data-testid=new-secret]').textContent({ timeout: DEADLINE_MS });
  const check = await fetch(`${base}/v1/resources`, { headers: { Authorization: `Bearer ${secret.trim()}` } });
  if (check.status !== 200) failures.push(`the key shown for ${made} answered ${check.status}`);
  await page.locator(`table[data-testid=tenants] tr[data-tenant="${made}"]`).waitFor({ timeout: DEADLINE_MS });
  await page.click(`button[data-keys="${made}"]`);
  const keyRows = page.locator(`[data-testid=api-keys] table[data-tenant="${made}"] tbody tr`);
  await until('the new tenant\'s one key', async () => (await keyRows.count()) === 1);
  const firstKeyId = await keyRows.first().getAttribute('data-key-id');
  await page.click(`table[data-testid=tenants] tr[data-tenant="${made}"] button:has-text("New API key")`);
  await until('its second key', async () => (await keyRows.count()) === 2);
  page.once('dialog', (d) => d.accept());
  await page.click(`button[data-revoke="${firstKeyId}"]`);
  await until('the first key revoked', async () => (await keyRows.first().textContent()).includes('revoked'));
  const revoked = await fetch(`${base}/v1/resources`, { headers: { Authorization: `Bearer ${secret.trim()}` } });
  if (revoked.status !== 401) failures.push(`the key revoked in the console answered ${revoked.status}`);
  await page.screenshot({ path: join(artifacts, 'operator-tenants.png'), fullPage: true });
  await page.goto(`${base}/console/#/health`);
  await until('readiness', async () => (await page.textContent('[data-testid=readiness]')) === 'ready');
  await page.screenshot({ path: join(artifacts, 'operator-health.png'), fullPage: true });

  step('a narrow screen still shows the resources as a table');
  await page.click('#signout');
  await page.setViewportSize({ width: 420, height: 800 });
  await page.fill('#token', apiKey);
  await page.click('#signin-button');
  await row.waitFor({ timeout: DEADLINE_MS });
  await page.screenshot({ path: join(artifacts, 'narrow.png'), fullPage: true });
} catch (e) {
  failures.push(e.stack || String(e));
  // Where the page was and what its footer said, and how it looked.
  for (const page of browser.contexts().flatMap((c) => c.pages())) {
    failures.push(`at ${page.url()}; footer: ${await page.textContent('#status').catch(() => '?')}`);
    await page.screenshot({ path: join(artifacts, 'failure.png'), fullPage: true }).catch(() => {});
  }
} finally {
  await browser.close();
}
if (failures.length) {
  process.stderr.write(failures.join('\n') + '\n');
  process.exit(1);
}
process.stdout.write('PASSED\n');
process.exit(0);
