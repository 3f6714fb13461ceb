// E2B routes beyond the core through the official JS SDK (driven by test_e2b_coverage.py). Usage:
//   node js_e2b_coverage.mjs <e2b/dist/index.mjs URL> <id of a sandbox paused with its memory>
// Prints `RESULT <json>`: what each call returned, or the error it raised ("<name>: <message>").
const [sdkPath, pausedId] = process.argv.slice(2);
const { Sandbox, Volume, Secret } = await import(sdkPath);

const failure = async (call) => {
  try {
    await call();
    return null;
  } catch (e) {
    return `${e.name}: ${e.message}`;
  }
};
const secrets = Secret.list();
const result = {
  volumes: await Volume.list(),
  volumeCreate: await failure(() => Volume.create('vol-js')),
  volumeInfo: await failure(() => Volume.getInfo('vol-js')),
  secrets: await secrets.nextItems(),
  secretsHasNext: secrets.hasNext,
  secretCreate: await failure(() => Secret.create('sec-js', 'value')),
  mount: await failure(() => Sandbox.create('base', { volumeMounts: { '/data': 'vol-js' }, timeoutMs: 60_000 })),
  reboot: await failure(() => Sandbox.connect(pausedId, { onResume: 'reboot' })),
};
console.log('RESULT ' + JSON.stringify(result));
