#!/usr/bin/env node
// tests/deploy/validate-manifests.js — validates rendered Kubernetes manifests offline.
//
//   node validate-manifests.js --deps DIR [--external-secret NAME]... MANIFESTS.yaml...
//
// DIR is the npm prefix tools/setup.sh installs into (.deps). Three layers, no network:
//  1. Schemas. Built-in kinds against the Kubernetes OpenAPI schemas compiled into the npm
//     package kubernetes-models (types, enums, required fields, formats); ServiceMonitor against
//     @kubernetes-models/prometheus-operator; LeaderWorkerSet against our own JSON schema
//     (schemas/leaderworkerset.x-k8s.io_v1.json, with ajv) with its pod templates checked as
//     core/v1 PodTemplateSpec; the Gateway API HTTPRoute against the schema of its CRD
//     (schemas/httproute.gateway.networking.k8s.io_v1.json, gateway-api v1.3.0).
//  2. Unknown fields. kubernetes-models' validators accept unknown properties (the API server
//     drops or, with strict field validation, rejects them); a misspelt field is the commonest
//     chart bug, so every object is also walked against the TypeScript declarations (.d.ts)
//     shipped in the same packages, which list every field of every type.
//  3. What the API server or the controllers check beyond the schema, and chart conventions:
//     DNS names and lengths, selectors that match their pod templates, Service target ports
//     that exist, volume mounts of declared volumes, $(VAR) references to earlier variables,
//     objects referenced by name that the render (or --external-secret) provides, recommended
//     labels, probes (native gRPC on the numeric grpc port, or HTTP GET on a declared port),
//     Ingress and HTTPRoute backends that are rendered Services with that port, non-root pods.
'use strict';

const fs = require('fs');
const path = require('path');
const Module = require('module');

const argv = process.argv.slice(2);
let deps = null;
const externalSecrets = new Set();
const files = [];
for (let i = 0; i < argv.length; i++) {
  if (argv[i] === '--deps') deps = argv[++i];
  else if (argv[i] === '--external-secret') externalSecrets.add(argv[++i]);
  else files.push(argv[i]);
}
if (!deps || files.length === 0) {
  console.error('usage: validate-manifests.js --deps DIR [--external-secret NAME]... FILE...');
  process.exit(2);
}
const nodeModules = path.resolve(deps, 'node_modules');
const req = Module.createRequire(path.join(path.resolve(deps), 'noop.js'));
let yaml, Ajv, ObjectMeta;
const models = {};
try {
  yaml = req('js-yaml');
  Ajv = req('ajv');
  for (const gv of ['v1', 'apps/v1', 'autoscaling/v2', 'policy/v1', 'networking.k8s.io/v1']) {
    models[gv] = { mod: req(`kubernetes-models/${gv}`), dts: path.join(nodeModules, 'kubernetes-models', gv) };
  }
  ({ ObjectMeta } = req('@kubernetes-models/apimachinery/apis/meta/v1/ObjectMeta'));
  models['monitoring.coreos.com/v1'] = {
    mod: req('@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1'),
    dts: path.join(nodeModules, '@kubernetes-models', 'prometheus-operator', 'monitoring.coreos.com', 'v1'),
  };
} catch (e) {
  console.error(`validate-manifests: missing npm packages in ${nodeModules} (run tools/setup.sh): ${e.message}`);
  process.exit(2);
}

// ---- .d.ts reader: a small parser for the declaration subset kubernetes-models emits --------

const typeCache = new Map(); // file -> parsed root type

function stripComments(s) {
  return s.replace(/\/\*[\s\S]*?\*\//g, '').replace(/^\s*\/\/.*$/gm, '');
}

function resolveModule(fromFile, spec) {
  if (spec.startsWith('.')) return path.resolve(path.dirname(fromFile), spec) + '.d.ts';
  // A package path: the nearest node_modules up from the importing file.
  for (let dir = path.dirname(fromFile); ; dir = path.dirname(dir)) {
    const cand = path.join(dir, 'node_modules', spec + '.d.ts');
    if (fs.existsSync(cand)) return cand;
    if (dir === path.dirname(dir)) break;
  }
  return path.join(nodeModules, spec + '.d.ts');
}

class TypeParser {
  constructor(text, file, imports) {
    this.s = text;
    this.i = 0;
    this.file = file;
    this.imports = imports;
  }
  ws() { while (this.i < this.s.length && /\s/.test(this.s[this.i])) this.i++; }
  peek(t) { this.ws(); return this.s.startsWith(t, this.i); }
  eat(t) {
    if (!this.peek(t)) throw new Error(`${this.file}: expected '${t}' at ...${this.s.slice(this.i, this.i + 40)}`);
    this.i += t.length;
  }
  type() {
    const alts = [this.postfix()];
    while (this.peek('|')) { this.eat('|'); alts.push(this.postfix()); }
    return alts.length === 1 ? alts[0] : { k: 'union', of: alts };
  }
  postfix() {
    let t = this.primary();
    while (this.peek('[]')) { this.eat('[]'); t = { k: 'arr', of: t }; }
    return t;
  }
  primary() {
    this.ws();
    if (this.peek('(')) { this.eat('('); const t = this.type(); this.eat(')'); return t; }
    if (this.peek('{')) return this.members();
    if (this.peek('"')) { const m = /^"(?:[^"\\]|\\.)*"/.exec(this.s.slice(this.i)); this.i += m[0].length; return { k: 'leaf' }; }
    const m = /^[A-Za-z_$][\w$.]*|^-?[0-9.]+/.exec(this.s.slice(this.i));
    if (!m) throw new Error(`${this.file}: cannot parse type at ...${this.s.slice(this.i, this.i + 40)}`);
    this.i += m[0].length;
    const name = m[0];
    if (name === 'Array' && this.peek('<')) { this.eat('<'); const of = this.type(); this.eat('>'); return { k: 'arr', of }; }
    if (this.imports[name]) return { k: 'ref', file: this.imports[name] };
    return { k: 'leaf' }; // string, number, boolean, literal, any, ...
  }
  members() {
    this.eat('{');
    const obj = { k: 'obj', props: {}, index: null };
    for (;;) {
      if (this.peek('}')) { this.eat('}'); return obj; }
      if (this.peek('[')) {
        this.eat('['); this.type(); // key: string
        this.ws();
        while (this.s[this.i] !== ']') this.i++;
        this.eat(']'); this.eat(':');
        obj.index = this.type();
      } else {
        this.ws();
        const m = /^"((?:[^"\\]|\\.)*)"|^([A-Za-z_$][\w$]*)/.exec(this.s.slice(this.i));
        if (!m) throw new Error(`${this.file}: cannot parse member at ...${this.s.slice(this.i, this.i + 40)}`);
        this.i += m[0].length;
        const name = m[1] !== undefined ? m[1] : m[2];
        if (this.peek('?')) this.eat('?');
        this.eat(':');
        obj.props[name] = this.type();
      }
      if (this.peek(';')) this.eat(';');
      else if (this.peek(',')) this.eat(',');
    }
  }
}

function loadDts(file) {
  if (typeCache.has(file)) return typeCache.get(file);
  const text = stripComments(fs.readFileSync(file, 'utf8'));
  const imports = {};
  for (const m of text.matchAll(/import\s*\{([^}]*)\}\s*from\s*"([^"]+)"/g)) {
    for (const part of m[1].split(',')) {
      const names = part.trim().split(/\s+as\s+/);
      const local = (names[1] || names[0]).trim();
      if (local && !/^(Model|ModelData|TypeMeta)$/.test(local)) imports[local] = resolveModule(file, m[2]);
    }
  }
  let t;
  const iface = /export\s+interface\s+\w+(?:\s+extends\s+[^{]+)?\s*\{/.exec(text);
  if (iface) {
    const p = new TypeParser(text, file, imports);
    p.i = iface.index + iface[0].length - 1;
    t = p.members();
  } else {
    const alias = /export\s+declare\s+type\s+\w+\s*=\s*/.exec(text);
    if (!alias) throw new Error(`${file}: no interface or type alias`);
    const p = new TypeParser(text, file, imports);
    p.i = alias.index + alias[0].length;
    t = p.type();
  }
  typeCache.set(file, t);
  return t;
}

function deref(t) {
  while (t && t.k === 'ref') t = loadDts(t.file);
  return t;
}

// Reports every property the declared type does not have.
function unknownFields(value, t, where, out) {
  t = deref(t);
  if (!t || value === null || value === undefined) return;
  if (t.k === 'union') {
    const structured = t.of.map(deref).filter((x) => x.k !== 'leaf');
    if (structured.length === 1) unknownFields(value, structured[0], where, out);
    return;
  }
  if (t.k === 'arr') {
    if (Array.isArray(value)) value.forEach((v, i) => unknownFields(v, t.of, `${where}[${i}]`, out));
    return;
  }
  if (t.k === 'obj' && typeof value === 'object' && !Array.isArray(value)) {
    for (const [key, v] of Object.entries(value)) {
      if (Object.prototype.hasOwnProperty.call(t.props, key)) unknownFields(v, t.props[key], `${where}.${key}`, out);
      else if (t.index) unknownFields(v, t.index, `${where}.${key}`, out);
      else out.push(`${where}: unknown field "${key}"`);
    }
  }
}

// ---- schema validation -----------------------------------------------------------------------

const ajv = new Ajv({ allErrors: true, strict: false });
const lwsValidate = ajv.compile(JSON.parse(fs.readFileSync(
  path.join(__dirname, 'schemas', 'leaderworkerset.x-k8s.io_v1.json'), 'utf8')));
const httpRouteValidate = ajv.compile(JSON.parse(fs.readFileSync(
  path.join(__dirname, 'schemas', 'httproute.gateway.networking.k8s.io_v1.json'), 'utf8')));
const ajvErrors = (v) => v.errors.map((e) => `${e.instancePath || '/'} ${e.message}${e.params && e.params.additionalProperty ? ` "${e.params.additionalProperty}"` : ''}`);

function modelErrors(Model, obj) {
  try {
    new Model(obj).validate();
    return [];
  } catch (e) {
    return String(e.message).split(/,\s(?=data)/).map((m) => m.trim());
  }
}

function validateSchema(doc) {
  const errs = [];
  const gv = doc.apiVersion;
  const kind = doc.kind;
  if (gv === 'leaderworkerset.x-k8s.io/v1' && kind === 'LeaderWorkerSet') {
    if (!lwsValidate(doc)) {
      for (const e of lwsValidate.errors) errs.push(`${e.instancePath || '/'} ${e.message}${e.params && e.params.additionalProperty ? ` "${e.params.additionalProperty}"` : ''}`);
    }
    const v1 = models.v1;
    errs.push(...modelErrors(ObjectMeta, doc.metadata || {}).map((m) => `metadata: ${m}`));
    unknownFields(doc.metadata, { k: 'ref', file: path.join(nodeModules, '@kubernetes-models', 'apimachinery', 'apis', 'meta', 'v1', 'ObjectMeta.d.ts') }, 'metadata', errs);
    const lwt = (doc.spec || {}).leaderWorkerTemplate || {};
    for (const which of ['leaderTemplate', 'workerTemplate']) {
      if (!lwt[which]) continue;
      errs.push(...modelErrors(v1.mod.PodTemplateSpec, lwt[which]).map((m) => `spec.leaderWorkerTemplate.${which}: ${m}`));
      unknownFields(lwt[which], { k: 'ref', file: path.join(v1.dts, 'PodTemplateSpec.d.ts') }, `spec.leaderWorkerTemplate.${which}`, errs);
    }
    return errs;
  }
  if (gv === 'gateway.networking.k8s.io/v1' && kind === 'HTTPRoute') {
    if (!httpRouteValidate(doc)) errs.push(...ajvErrors(httpRouteValidate));
    errs.push(...modelErrors(ObjectMeta, doc.metadata || {}).map((m) => `metadata: ${m}`));
    unknownFields(doc.metadata, { k: 'ref', file: path.join(nodeModules, '@kubernetes-models', 'apimachinery', 'apis', 'meta', 'v1', 'ObjectMeta.d.ts') }, 'metadata', errs);
    return errs;
  }
  const group = models[gv];
  if (!group || !group.mod[kind]) return [`no schema for ${gv} ${kind} (teach validate-manifests.js about it)`];
  errs.push(...modelErrors(group.mod[kind], doc));
  unknownFields(doc, { k: 'ref', file: path.join(group.dts, `${kind}.d.ts`) }, '', errs);
  return errs.map((e) => e.replace(/^\./, ''));
}

// ---- what the API server and controllers check beyond the schema ----------------------------

const DNS_LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const DNS_SUBDOMAIN = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;
const LABEL_VALUE = /^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$/;
const RECOMMENDED = ['app.kubernetes.io/name', 'app.kubernetes.io/instance', 'app.kubernetes.io/version',
  'app.kubernetes.io/managed-by', 'helm.sh/chart'];

// An exec probe `piectl --tls-ca F [--timeout MS] --addr localhost:PORT --service NAME health`:
// {port, service, ca} or {error}; null when the probe is not an exec one.
function pieTlsProbe(pr) {
  if (!pr.exec) return null;
  const cmd = pr.exec.command || [];
  if (cmd[0] !== '/usr/local/bin/piectl' || cmd[cmd.length - 1] !== 'health') return { error: 'an exec probe must run /usr/local/bin/piectl ... health' };
  const opt = (name) => { const i = cmd.indexOf(name); return i > 0 && i + 1 < cmd.length - 1 ? cmd[i + 1] : undefined; };
  const ca = opt('--tls-ca');
  const m = /^localhost:(\d+)$/.exec(opt('--addr') || '');
  if (!ca) return { error: 'piectl health without --tls-ca' };
  if (!m) return { error: `piectl health --addr "${opt('--addr')}" is not localhost:<port>` };
  return { port: Number(m[1]), service: opt('--service') || '', ca };
}

function subset(sel, labels) {
  return Object.entries(sel || {}).every(([k, v]) => labels && labels[k] === v);
}

// Pod templates of a workload: [{where, template, isTest}]
function podTemplates(doc) {
  const s = doc.spec || {};
  switch (doc.kind) {
    case 'Deployment': case 'StatefulSet': return [{ where: 'spec.template', t: s.template }];
    case 'LeaderWorkerSet': {
      const lwt = s.leaderWorkerTemplate || {};
      const out = [{ where: 'spec.leaderWorkerTemplate.workerTemplate', t: lwt.workerTemplate }];
      if (lwt.leaderTemplate) out.push({ where: 'spec.leaderWorkerTemplate.leaderTemplate', t: lwt.leaderTemplate });
      return out;
    }
    case 'Pod': return [{ where: '', t: { metadata: doc.metadata, spec: doc.spec }, isTest: true }];
    default: return [];
  }
}

function checkPod(where, t, isTest, byKind, errs) {
  const spec = (t && t.spec) || {};
  const p = where ? `${where}.spec` : 'spec';
  const volumes = new Map((spec.volumes || []).map((v) => [v.name, v]));
  if (volumes.size !== (spec.volumes || []).length) errs.push(`${p}.volumes: duplicate names`);
  const psc = spec.securityContext || {};
  if (psc.runAsNonRoot !== true) errs.push(`${p}.securityContext.runAsNonRoot must be true`);
  if (spec.automountServiceAccountToken !== false) errs.push(`${p}.automountServiceAccountToken must be false (the services never call the API)`);
  if (spec.enableServiceLinks !== false) errs.push(`${p}.enableServiceLinks must be false (service links inject PIE_* variables)`);
  for (const [name, v] of volumes) {
    if (v.configMap && !byKind('ConfigMap', v.configMap.name)) errs.push(`${p}.volumes[${name}]: ConfigMap "${v.configMap.name}" is not rendered`);
    if (v.secret && !byKind('Secret', v.secret.secretName) && !externalSecrets.has(v.secret.secretName)) {
      errs.push(`${p}.volumes[${name}]: Secret "${v.secret.secretName}" is neither rendered nor --external-secret`);
    }
  }
  const all = [...(spec.initContainers || []).map((c) => ['initContainers', c]), ...(spec.containers || []).map((c) => ['containers', c])];
  for (const [list, c] of all) {
    const cp = `${p}.${list}[${c.name}]`;
    if (!DNS_LABEL.test(c.name || '')) errs.push(`${cp}: container name is not a DNS label`);
    const sc = c.securityContext || {};
    if (sc.allowPrivilegeEscalation !== false) errs.push(`${cp}.securityContext.allowPrivilegeEscalation must be false`);
    if (sc.readOnlyRootFilesystem !== true) errs.push(`${cp}.securityContext.readOnlyRootFilesystem must be true`);
    const mounts = new Set();
    for (const m of c.volumeMounts || []) {
      if (!volumes.has(m.name)) errs.push(`${cp}.volumeMounts[${m.name}]: no such volume`);
      if (mounts.has(m.mountPath)) errs.push(`${cp}.volumeMounts: ${m.mountPath} mounted twice`);
      mounts.add(m.mountPath);
    }
    // $(VAR) in env values, command and args expands only variables defined earlier in env.
    const seen = new Set();
    const refs = (s, at) => {
      for (const m of String(s).matchAll(/(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
        if (!seen.has(m[1])) errs.push(`${at}: $(${m[1]}) is not defined earlier in env, so it stays literal`);
      }
    };
    const envNames = new Set();
    for (const e of c.env || []) {
      if (envNames.has(e.name)) errs.push(`${cp}.env: ${e.name} set twice`);
      envNames.add(e.name);
      if (e.value !== undefined) refs(e.value, `${cp}.env[${e.name}]`);
      const skr = e.valueFrom && e.valueFrom.secretKeyRef;
      if (skr && !byKind('Secret', skr.name) && !externalSecrets.has(skr.name)) {
        errs.push(`${cp}.env[${e.name}]: Secret "${skr.name}" is neither rendered nor --external-secret`);
      }
      seen.add(e.name);
    }
    for (const a of [...(c.command || []), ...(c.args || [])]) refs(a, `${cp}.command/args`);
    const portNames = new Set();
    for (const port of c.ports || []) {
      if (port.name) {
        if (port.name.length > 15 || !/^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/.test(port.name)) errs.push(`${cp}.ports: bad port name "${port.name}" (IANA_SVC_NAME, at most 15 characters)`);
        if (portNames.has(port.name)) errs.push(`${cp}.ports: duplicate name ${port.name}`);
        portNames.add(port.name);
      }
    }
    if (isTest || list === 'initContainers') continue;
    const grpcPort = (c.ports || []).find((x) => x.name === 'grpc');
    for (const probe of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
      const pr = c[probe];
      if (!pr) { errs.push(`${cp}: no ${probe}`); continue; }
      if (pr.httpGet) {
        // HTTP probes (the gateway's /healthz, /readyz): a declared port, an absolute path.
        const hp = pr.httpGet.port;
        const declared = (c.ports || []).some((x) => (typeof hp === 'number' ? x.containerPort === hp : x.name === hp));
        if (!declared) errs.push(`${cp}.${probe}.httpGet.port ${hp} is not a port of the container`);
        if (!String(pr.httpGet.path || '').startsWith('/')) errs.push(`${cp}.${probe}.httpGet.path "${pr.httpGet.path}" is not an absolute path`);
        continue;
      }
      const tlsProbe = pieTlsProbe(pr);
      if (tlsProbe) {
        // With TLS the chart probes by piectl over TLS (native gRPC probes are plaintext).
        if (tlsProbe.error) errs.push(`${cp}.${probe}.exec: ${tlsProbe.error}`);
        else if (!grpcPort || grpcPort.containerPort !== tlsProbe.port) errs.push(`${cp}.${probe}.exec: piectl --addr port ${tlsProbe.port} is not the container's grpc port`);
        continue;
      }
      if (!pr.grpc) { errs.push(`${cp}.${probe}: neither a native gRPC probe nor an HTTP GET nor piectl health over TLS`); continue; }
      if (!Number.isInteger(pr.grpc.port)) errs.push(`${cp}.${probe}.grpc.port must be a number`);
      if (!grpcPort || grpcPort.containerPort !== pr.grpc.port) errs.push(`${cp}.${probe}.grpc.port ${pr.grpc.port} is not the container's grpc port`);
    }
    const lim = (c.resources || {}).limits || {};
    const rq = (c.resources || {}).requests || {};
    if (!lim.memory) errs.push(`${cp}.resources.limits.memory is not set`);
    for (const [k, v] of Object.entries(lim)) {
      if (k.includes('/') && rq[k] !== undefined && String(rq[k]) !== String(v)) errs.push(`${cp}.resources: ${k} request ${rq[k]} != limit ${v} (extended resources cannot overcommit)`);
    }
  }
}

function semanticChecks(docs) {
  const errors = [];
  const index = new Map();
  for (const d of docs) {
    const key = `${d.kind}/${(d.metadata || {}).name}`;
    if (index.has(key)) errors.push(`${key}: rendered twice`);
    index.set(key, d);
  }
  const byKind = (kind, name) => index.get(`${kind}/${name}`);
  const pods = []; // {owner, labels, ports:Set of named ports}
  for (const d of docs) {
    for (const { t } of podTemplates(d)) {
      const names = new Set();
      for (const c of ((t && t.spec) || {}).containers || []) for (const p of c.ports || []) if (p.name) names.add(p.name);
      pods.push({ owner: `${d.kind}/${d.metadata.name}`, labels: (t.metadata || {}).labels || {}, ports: names });
    }
  }
  for (const d of docs) {
    const md = d.metadata || {};
    const id = `${d.kind}/${md.name}`;
    const errs = [];
    if (!md.name || !DNS_SUBDOMAIN.test(md.name) || md.name.length > 253) errs.push('metadata.name is not a DNS subdomain');
    if (['Service', 'StatefulSet', 'LeaderWorkerSet', 'Deployment'].includes(d.kind) && md.name && md.name.length > 63) errs.push('metadata.name longer than 63 characters');
    if (d.kind === 'StatefulSet' && `${md.name}-${Math.max(0, (d.spec.replicas || 1) - 1)}`.length > 63) errs.push('pod names would exceed 63 characters');
    if (d.kind === 'LeaderWorkerSet') {
      const n = `${md.name}-${Math.max(0, (d.spec.replicas || 1) - 1)}-${Math.max(0, (d.spec.leaderWorkerTemplate.size || 1) - 1)}`;
      if (n.length > 63) errs.push(`pod names (${n}) would exceed 63 characters`);
    }
    for (const [k, v] of Object.entries(md.labels || {})) {
      if (typeof v !== 'string' || v.length > 63 || !LABEL_VALUE.test(v)) errs.push(`label ${k}: invalid value "${v}"`);
    }
    if (d.kind !== 'Pod' || !(md.annotations || {})['helm.sh/hook']) {
      for (const k of RECOMMENDED) if (!(md.labels || {})[k]) errs.push(`missing recommended label ${k}`);
    }
    const sel = ((d.spec || {}).selector || {}).matchLabels;
    if (d.kind === 'Deployment' || d.kind === 'StatefulSet') {
      if (!subset(sel, ((d.spec.template || {}).metadata || {}).labels)) errs.push('spec.selector does not match spec.template.metadata.labels');
      if (!sel || !sel['app.kubernetes.io/component']) errs.push('spec.selector must include app.kubernetes.io/component (components must not select each other)');
    }
    if (d.kind === 'StatefulSet') {
      const svc = byKind('Service', d.spec.serviceName);
      if (!svc) errs.push(`spec.serviceName "${d.spec.serviceName}" is not a rendered Service`);
      else if (svc.spec.clusterIP !== 'None') errs.push(`spec.serviceName "${d.spec.serviceName}" must be headless`);
    }
    if (d.kind === 'Service') {
      const matching = pods.filter((p) => subset(d.spec.selector, p.labels));
      if (!d.spec.selector || matching.length === 0) errs.push('spec.selector matches no rendered pod template');
      for (const port of d.spec.ports || []) {
        if (typeof port.targetPort === 'string' && !matching.every((p) => p.ports.has(port.targetPort))) {
          errs.push(`port ${port.name}: targetPort "${port.targetPort}" is not a named port of every selected pod`);
        }
      }
    }
    // An Ingress or HTTPRoute backend is a rendered Service with that port (by name or number).
    const backend = (where, name, port) => {
      const svc = byKind('Service', name);
      if (!svc) { errs.push(`${where}: Service "${name}" is not rendered`); return; }
      if (!(svc.spec.ports || []).some((p) => (typeof port === 'number' ? p.port === port : p.name === port))) errs.push(`${where}: Service ${name} has no port ${port}`);
    };
    if (d.kind === 'Ingress') {
      (d.spec.rules || []).forEach((r, i) => ((r.http || {}).paths || []).forEach((p, j) => {
        const s = (p.backend || {}).service;
        if (s) backend(`spec.rules[${i}].http.paths[${j}].backend`, s.name, s.port.name !== undefined ? s.port.name : s.port.number);
      }));
    }
    if (d.kind === 'HTTPRoute') {
      (d.spec.rules || []).forEach((r, i) => (r.backendRefs || []).forEach((b, j) => {
        if ((b.kind || 'Service') === 'Service' && !b.group) backend(`spec.rules[${i}].backendRefs[${j}]`, b.name, b.port);
      }));
    }
    if (d.kind === 'PodDisruptionBudget' && !pods.some((p) => subset(sel, p.labels))) errs.push('spec.selector matches no rendered pod template');
    if (d.kind === 'HorizontalPodAutoscaler') {
      const ref = d.spec.scaleTargetRef;
      const target = byKind(ref.kind, ref.name);
      if (!target) errs.push(`scaleTargetRef ${ref.kind}/${ref.name} is not rendered`);
      else if (target.spec.replicas !== undefined) errs.push(`scaleTargetRef ${ref.kind}/${ref.name} sets spec.replicas, which fights the autoscaler`);
      if (d.spec.minReplicas > d.spec.maxReplicas) errs.push('minReplicas > maxReplicas');
    }
    if (d.kind === 'ServiceMonitor') {
      const svcs = docs.filter((x) => x.kind === 'Service' && subset(d.spec.selector.matchLabels, x.metadata.labels));
      if (svcs.length === 0) errs.push('spec.selector matches no rendered Service');
      for (const ep of d.spec.endpoints || []) {
        for (const s of svcs) if (!(s.spec.ports || []).some((p) => p.name === ep.port)) errs.push(`Service ${s.metadata.name} has no port "${ep.port}"`);
      }
    }
    for (const { where, t, isTest } of podTemplates(d)) checkPod(where, t, isTest, byKind, errs);
    for (const e of errs) errors.push(`${id}: ${e}`);
  }
  return errors;
}

// ---- main ------------------------------------------------------------------------------------

let failures = 0;
const argExternalSecrets = new Set(externalSecrets);
for (const file of files) {
  const text = fs.readFileSync(file, 'utf8');
  const docs = yaml.loadAll(text).filter((d) => d && typeof d === 'object');
  // A Secret the render itself names for the operator to create (helm/pie/templates/secret.yaml
  // on an offline render) counts as --external-secret, for this file only.
  externalSecrets.clear();
  for (const n of argExternalSecrets) externalSecrets.add(n);
  for (const m of text.matchAll(/^# pie: external Secret (\S+) /gm)) externalSecrets.add(m[1]);
  const errors = [];
  const kinds = {};
  for (const d of docs) {
    const id = `${d.kind}/${(d.metadata || {}).name}`;
    kinds[d.kind] = (kinds[d.kind] || 0) + 1;
    for (const e of validateSchema(d)) errors.push(`${id}: ${e}`);
  }
  errors.push(...semanticChecks(docs));
  if (errors.length) {
    failures++;
    console.log(`FAIL ${file}: ${errors.length} problem(s)`);
    for (const e of errors) console.log(`  ${e}`);
  } else {
    const summary = Object.entries(kinds).map(([k, n]) => `${n} ${k}`).join(', ');
    console.log(`ok ${file}: ${docs.length} objects valid offline (${summary})`);
  }
}
process.exit(failures ? 1 : 0);
