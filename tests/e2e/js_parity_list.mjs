// Issue 14 item 2 through the official JS SDK (driven by test_e2e_parity_list.py). Usage:
//   node js_parity_list.mjs <e2b/dist/index.mjs URL> <metadata tag>
// Lists the sandboxes the Python test created with metadata {parity: <tag>} and prints `RESULT <json>`.
const [sdkPath, tag] = process.argv.slice(2);
const { Sandbox } = await import(sdkPath);

const metadata = { parity: tag };
async function all(opts) {
  const paginator = Sandbox.list(opts);
  const pages = [];
  while (paginator.hasNext) pages.push((await paginator.nextItems()).map((s) => s.sandboxId));
  return pages;
}
const ids = async (opts) => (await all(opts)).flat();

const desc = await ids({ query: { metadata } });
const ownStartedAt = {};
const plusOneSecond = {};
for (const sandboxId of desc) {
  const { startedAt } = await Sandbox.getInfo(sandboxId);
  ownStartedAt[sandboxId] = await ids({ query: { metadata, startedAfter: startedAt } });
  plusOneSecond[sandboxId] = await ids({ query: { metadata, startedAfter: new Date(startedAt.getTime() + 1000) } });
}
const result = {
  desc,
  asc: await ids({ query: { metadata }, order: 'asc' }),
  paused: await ids({ query: { metadata, state: ['paused'] } }),
  running: await ids({ query: { metadata, state: ['running'] } }),
  byTemplate: await ids({ query: { metadata, template: 'base' } }),
  n1: await ids({ query: { metadata: { ...metadata, n: '1' } } }),
  pagesDesc: await all({ query: { metadata }, limit: 1 }),
  ownStartedAt,
  plusOneSecond,
};
console.log('RESULT ' + JSON.stringify(result));
