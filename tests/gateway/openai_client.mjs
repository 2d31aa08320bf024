// tests/gateway/openai_client.mjs — pie-gateway through the official `openai` npm client.
//
// Run by tests/gateway/run.sh inside a local cluster (deploy/local/pie-local.sh --exec), which
// exports PIE_LOCAL_GATEWAYS, PIE_LOCAL_LIFECYCLES, PIE_LOCAL_BIN; run.sh adds PIE_TEST_TOKEN
// (the cluster's bearer token), PIE_TEST_DEPS (node_modules with openai) and
// PIE_TEST_INFERLETS (the built .wasm files). Each check prints "ok - name" or
// "not ok - name: why"; the exit status is the number of failures (capped at 100).
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { createRequire } from 'node:module';
import http from 'node:http';

const require = createRequire(process.env.PIE_TEST_DEPS + '/');
const OpenAIModule = require('openai');
const OpenAI = OpenAIModule.OpenAI ?? OpenAIModule.default ?? OpenAIModule;

const gateway = process.env.PIE_LOCAL_GATEWAYS.split(' ')[0];
const lifecycles = process.env.PIE_LOCAL_LIFECYCLES.split(' ');
const token = process.env.PIE_TEST_TOKEN;
const bin = process.env.PIE_LOCAL_BIN;
const inferlets = process.env.PIE_TEST_INFERLETS;

const client = new OpenAI({ baseURL: gateway + '/v1', apiKey: token, maxRetries: 0, timeout: 120000 });
const checks = [];
const check = (name, fn) => checks.push({ name, fn });

let model = '';
const prompt = 'Once upon a time, there was a little';
const chatMessages = [
  { role: 'system', content: 'You are a helpful assistant.' },
  { role: 'user', content: 'Tell me a story about a cat.' },
];

// Raw HTTP, for what the client hides (framing, status lines, bad JSON).
function raw(method, path, body, headers = {}) {
  return new Promise((resolve, reject) => {
    const u = new URL(gateway + path);
    const req = http.request({ host: u.hostname, port: u.port, path: u.pathname, method, agent: false,
      headers: { authorization: `Bearer ${token}`, ...headers } }, (res) => {
      const parts = [];
      res.on('data', (d) => parts.push(d));
      res.on('end', () => resolve({ status: res.statusCode, headers: res.headers,
        body: Buffer.concat(parts).toString('utf8') }));
    });
    req.on('error', reject);
    if (body !== undefined) req.write(body);
    req.end();
  });
}

async function expectApiError(promise, status, fields = {}) {
  try {
    await promise;
  } catch (e) {
    assert.equal(e.status, status, `HTTP status ${e.status} (${e.message})`);
    for (const [k, v] of Object.entries(fields)) assert.equal(e[k] ?? e.error?.[k], v, `error.${k}`);
    assert.ok(typeof e.error?.message === 'string' && e.error.message.length > 0, 'error.message');
    return e;
  }
  assert.fail(`expected HTTP ${status}, the request succeeded`);
}

const greedy = { temperature: 0 };

check('models.list names the served model', async () => {
  const list = await client.models.list();
  assert.ok(list.data.length >= 1, 'at least one model');
  model = list.data[0].id;
  assert.equal(list.data[0].object, 'model');
  const one = await client.models.retrieve(model);
  assert.equal(one.id, model);
});

check('chat completion (not streamed): content, finish_reason length, usage', async () => {
  const r = await client.chat.completions.create({ model, messages: chatMessages, max_tokens: 8,
    ...greedy, ignore_eos: true });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 8);
  assert.ok(r.usage.prompt_tokens > 10, `prompt_tokens ${r.usage.prompt_tokens}`);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 8);
});

check('chat streamed equals chat not streamed; role first; usage chunk', async () => {
  const req = { model, messages: chatMessages, max_tokens: 12, ...greedy, ignore_eos: true };
  const full = await client.chat.completions.create(req);
  const stream = await client.chat.completions.create({ ...req, stream: true,
    stream_options: { include_usage: true } });
  let text = '', role = null, finish = null, usage = null, n = 0;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (n++ === 0) role = c.delta.role;
      text += c.delta.content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(role, 'assistant');
  assert.equal(text, full.choices[0].message.content);
  assert.equal(finish, 'length');
  assert.ok(usage, 'a usage chunk');
  assert.equal(usage.completion_tokens, 12);
  assert.equal(usage.prompt_tokens, full.usage.prompt_tokens);
});

check('completions greedy output equals `piectl run text_completion`', async () => {
  const r = await client.completions.create({ model, prompt, max_tokens: 16, ...greedy });
  assert.equal(r.object, 'text_completion');
  const out = execFileSync(`${bin}/piectl`, ['--addr', lifecycles[0], '--token', token,
    '--timeout', '60000', 'run', '--no-stdin', `${inferlets}/text_completion.wasm`,
    '--prompt', prompt, '--max-tokens', '16'], { encoding: 'utf8' });
  assert.ok(out.startsWith(r.choices[0].text + '\n'),
    `gateway ${JSON.stringify(r.choices[0].text)} vs piectl ${JSON.stringify(out.slice(0, 200))}`);
});

check('completions streamed equals completions not streamed', async () => {
  const req = { model, prompt, max_tokens: 10, ...greedy };
  const full = await client.completions.create(req);
  const stream = await client.completions.create({ ...req, stream: true });
  let text = '', finish = null;
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      text += c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(text, full.choices[0].text);
  assert.equal(finish, full.choices[0].finish_reason);
});

check('n = 2 with a seed: two choices, reproducible', async () => {
  const req = { model, prompt, max_tokens: 12, temperature: 1, n: 2, seed: 42, ignore_eos: true };
  const a = await client.completions.create(req);
  const b = await client.completions.create(req);
  assert.equal(a.choices.length, 2);
  assert.deepEqual(a.choices.map((c) => c.index).sort(), [0, 1]);
  assert.deepEqual(a.choices.map((c) => c.text), b.choices.map((c) => c.text));
  assert.equal(a.usage.completion_tokens, 24);
  const c = await client.completions.create({ ...req, seed: 43 });
  assert.notDeepEqual(c.choices.map((x) => x.text), a.choices.map((x) => x.text));
});

check('a stop string cuts the text and finishes with stop', async () => {
  const full = await client.completions.create({ model, prompt, max_tokens: 24, ...greedy,
    ignore_eos: true });
  const text = full.choices[0].text;
  assert.ok(text.length >= 8, `greedy text long enough: ${JSON.stringify(text)}`);
  const at = Math.floor(text.length / 2);
  const stop = text.slice(at, at + 3);
  const cut = await client.completions.create({ model, prompt, max_tokens: 24, ...greedy,
    ignore_eos: true, stop: [stop, 'zzzzqqq'] });
  assert.equal(cut.choices[0].text, text.slice(0, text.indexOf(stop)));
  assert.equal(cut.choices[0].finish_reason, 'stop');
});

check('chat logprobs: top_logprobs sorted, greedy token is the most likely', async () => {
  const r = await client.chat.completions.create({ model, messages: chatMessages, max_tokens: 5,
    ...greedy, ignore_eos: true, logprobs: true, top_logprobs: 3 });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, 5);
  for (const t of content) {
    assert.ok(t.logprob <= 0, `logprob ${t.logprob}`);
    assert.equal(t.top_logprobs.length, 3);
    assert.ok(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob);
    assert.ok(t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob);
    assert.equal(t.token, t.top_logprobs[0].token);
    assert.ok(Math.abs(t.logprob - t.top_logprobs[0].logprob) < 1e-9);
    assert.ok(Array.isArray(t.bytes));
  }
  assert.equal(content.map((t) => Buffer.from(t.bytes).toString('latin1')).length, 5);
});

check('completions logprobs: tokens, token_logprobs, top_logprobs, text_offset', async () => {
  const r = await client.completions.create({ model, prompt, max_tokens: 4, ...greedy,
    ignore_eos: true, logprobs: 2 });
  const lp = r.choices[0].logprobs;
  assert.equal(lp.tokens.length, 4);
  assert.equal(lp.token_logprobs.length, 4);
  assert.equal(lp.top_logprobs.length, 4);
  assert.equal(lp.text_offset.length, 4);
  assert.equal(lp.text_offset[0], 0);
  assert.ok(Object.keys(lp.top_logprobs[0]).length <= 2);
});

check('errors: unknown model is 404 model_not_found', async () => {
  await expectApiError(client.chat.completions.create({ model: 'no-such-model',
    messages: chatMessages }), 404, { code: 'model_not_found' });
});

check('errors: a bad value is 400 naming the parameter', async () => {
  await expectApiError(client.chat.completions.create({ model, messages: chatMessages,
    temperature: 5 }), 400, { param: 'temperature' });
  await expectApiError(client.completions.create({ model, prompt, n: 0 }), 400, { param: 'n' });
  await expectApiError(client.completions.create({ model, prompt, stop: ['a', 'b', 'c', 'd', 'e'] }),
    400, { param: 'stop' });
});

check('errors: bad JSON is 400 with OpenAI error JSON', async () => {
  const r = await raw('POST', '/v1/chat/completions', '{"model": ', { 'content-type': 'application/json' });
  assert.equal(r.status, 400);
  const e = JSON.parse(r.body).error;
  assert.equal(e.type, 'invalid_request_error');
  assert.ok(e.message.includes('JSON'));
});

check('errors: a missing or wrong key is 401', async () => {
  const anon = new OpenAI({ baseURL: gateway + '/v1', apiKey: 'wrong-key', maxRetries: 0 });
  await expectApiError(anon.chat.completions.create({ model, messages: chatMessages }), 401,
    { code: 'invalid_api_key' });
  const r = await raw('POST', '/v1/completions', JSON.stringify({ model, prompt }),
    { authorization: '' });
  assert.equal(r.status, 401);
  const odd = await raw('GET', '/v1/models', undefined, { authorization: 'Bearer caf\u00e9' });
  assert.equal(odd.status, 401, 'a key a gRPC header cannot carry');
  assert.equal(JSON.parse(odd.body).error.code, 'invalid_api_key');
});

check('errors: too many tokens is 400 context_length_exceeded', async () => {
  await expectApiError(client.completions.create({ model, prompt, max_tokens: 10000000 }), 400,
    { code: 'context_length_exceeded' });
});

check('errors: unknown path 404, wrong method 405', async () => {
  assert.equal((await raw('GET', '/v1/nothing')).status, 404);
  const r = await raw('GET', '/v1/chat/completions');
  assert.equal(r.status, 405);
  assert.equal(r.headers.allow, 'POST');
});

check('SSE framing: data events, blank-line separated, ending with [DONE]', async () => {
  const r = await raw('POST', '/v1/completions', JSON.stringify({ model, prompt, max_tokens: 3,
    ...greedy, ignore_eos: true, stream: true }), { 'content-type': 'application/json' });
  assert.equal(r.status, 200);
  assert.equal(r.headers['content-type'], 'text/event-stream');
  assert.ok(r.body.endsWith('data: [DONE]\n\n'), JSON.stringify(r.body.slice(-40)));
  const events = r.body.split('\n\n').filter((e) => e.length > 0);
  for (const e of events) assert.ok(e.startsWith('data: ') && !e.slice(6).includes('\n'), e);
  for (const e of events.slice(0, -1)) JSON.parse(e.slice(6));
});

check('a client that disconnects mid-stream cancels its Run', async () => {
  const before = await disconnects();
  const ac = new AbortController();
  const stream = await client.completions.create({ model, prompt, max_tokens: 1000, ...greedy,
    ignore_eos: true, stream: true }, { signal: ac.signal });
  let chunks = 0;
  try {
    for await (const _ of stream) if (++chunks === 3) ac.abort();
  } catch (e) {
    if (e.name !== 'AbortError' && !String(e).includes('abort')) throw e;
  }
  let ps = '';
  for (let i = 0; i < 100; i++) {
    ps = instances();
    if ((await disconnects()) > before && !/ running /.test(ps) && /openai_chat.*CANCELLED/.test(ps)) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.fail(`disconnects ${await disconnects()} (before ${before}); instances:\n${ps}`);
});

async function disconnects() {
  const m = await raw('GET', '/metrics');
  const line = m.body.split('\n').find((l) => l.startsWith('pie_gateway_client_disconnects_total'));
  return Number(line?.split(' ')[1] ?? 0);
}

// Last: it stops the gateway. SIGTERM drains: the stream in flight ends normally, new
// connections are refused, the process exits 0. pie-local.sh leaves a service whose pid file
// was removed out of its clean-stop check, so the test waits for the exit itself.
check('SIGTERM drains: a stream in flight finishes, new connections are refused', async () => {
  const fs = await import('node:fs');
  const pidFile = `${process.env.PIE_LOCAL_RUN_DIR}/pids/gateway-0.pid`;
  const pid = Number(fs.readFileSync(pidFile, 'utf8'));
  const stream = await client.completions.create({ model, prompt, max_tokens: 300, ...greedy,
    ignore_eos: true, stream: true });
  let tokens = 0, finish = null, signalled = false;
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      if (c.text) tokens++;
      if (c.finish_reason) finish = c.finish_reason;
    }
    if (!signalled) {
      fs.unlinkSync(pidFile);
      process.kill(pid, 'SIGTERM');
      signalled = true;
      await new Promise((r) => setTimeout(r, 200));
      await assert.rejects(raw('GET', '/healthz'), 'a new connection after SIGTERM is refused');
    }
  }
  assert.equal(finish, 'length');
  assert.ok(tokens >= 290, `tokens streamed after SIGTERM: ${tokens}`);
  for (let i = 0; i < 100; i++) {
    try { process.kill(pid, 0); } catch { return; } // gone
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.fail('the gateway did not exit after draining');
});

// `piectl ps` of every replica: running instances and those that exited within a minute.
function instances() {
  return lifecycles.map((lc) => execFileSync(`${bin}/piectl`, ['--addr', lc, '--token', token, 'ps'],
    { encoding: 'utf8' })).join('');
}

let failed = 0;
for (const { name, fn } of checks) {
  try {
    await fn();
    console.log(`ok - ${name}`);
  } catch (e) {
    failed++;
    console.log(`not ok - ${name}: ${e.stack ?? e}`);
  }
}
console.log(`gateway: ${checks.length - failed} passed, ${failed} failed`);
process.exit(Math.min(failed, 100));
