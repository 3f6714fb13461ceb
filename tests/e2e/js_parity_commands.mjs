// Issue 14 items 3 and 5 through the official JS SDK (driven by test_e2e_parity_commands.py). Usage:
//   node js_parity_commands.mjs <e2b/dist/index.mjs URL> timeouts <runs>
//   node js_parity_commands.mjs <e2b/dist/index.mjs URL> killed
// Prints one line `RESULT <json>`; E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY come from the environment.
const [sdkPath, mode, runsArg] = process.argv.slice(2);
const { Sandbox, TimeoutError, CommandExitError } = await import(sdkPath);

const describe = (e, started) => ({
  timeoutError: e instanceof TimeoutError,
  exitError: e instanceof CommandExitError,
  name: e?.constructor?.name,
  message: String(e?.message ?? e),
  seconds: (Date.now() - started) / 1000,
});

async function timeouts(runs) {
  const sbx = await Sandbox.create({ timeoutMs: 300_000, metadata: { suite: 'e2e', module: 'parity_commands_js' } });
  try {
    const out = [];
    for (let i = 0; i < runs; i++) {
      const started = Date.now();
      try {
        const r = await sbx.commands.run(`sleep 10.${i}3`, { timeoutMs: 2000 });
        out.push({ returned: true, exitCode: r.exitCode, seconds: (Date.now() - started) / 1000 });
      } catch (e) {
        out.push(describe(e, started));
      }
    }
    return { runs: out };
  } finally {
    await sbx.kill().catch(() => {});
  }
}

async function waitError(sbx, end) {
  const handle = await sbx.commands.run('sleep 120', { background: true });
  const timer = setTimeout(end, 1000);
  const started = Date.now();
  try {
    const r = await handle.wait();
    return { returned: true, exitCode: r.exitCode };
  } catch (e) {
    return describe(e, started);
  } finally {
    clearTimeout(timer);
  }
}

async function killed() {
  const meta = { suite: 'e2e', module: 'parity_commands_js' };
  const a = await Sandbox.create({ timeoutMs: 300_000, metadata: meta });
  let b;
  try {
    const kill = await waitError(a, () => Sandbox.kill(a.sandboxId));
    b = await Sandbox.create({ timeoutMs: 3_000, metadata: meta });
    const endOfLife = await waitError(b, () => {}); // its 3 s timeout ends it
    return { kill, endOfLife };
  } finally {
    await a.kill().catch(() => {});
    if (b) await b.kill().catch(() => {});
  }
}

const result = mode === 'timeouts' ? await timeouts(Number(runsArg || 10)) : await killed();
console.log('RESULT ' + JSON.stringify(result));
