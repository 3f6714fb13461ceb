// Drives envd with the JS SDK's envd-level clients (no control plane). Usage:
//   node js_smoke.mjs <path to e2b/dist/index.mjs> <envd url> <access token> <workdir>
const [sdkPath, url, token, workdir] = process.argv.slice(2);
const { Sandbox, CommandExitError } = await import(sdkPath);

const sbx = new Sandbox({
  sandboxId: "envdtest", envdAccessToken: token, envdVersion: "0.6.13", sandboxUrl: url,
  apiKey: "e2b_" + "0".repeat(40), requestTimeoutMs: 30000,
});
const check = (cond, msg) => { if (!cond) throw new Error("check failed: " + msg); };

const chunks = [];
const r = await sbx.commands.run("echo a; sleep 0.3; echo b >&2", { onStdout: (d) => chunks.push(d) });
check(r.stdout === "a\n" && r.stderr === "b\n" && r.exitCode === 0, "run output " + JSON.stringify(r));
check(chunks.join("") === "a\n", "onStdout");
try {
  await sbx.commands.run("exit 4");
  check(false, "exit 4 should throw");
} catch (e) {
  check(e instanceof CommandExitError && e.exitCode === 4, "exit code error " + e);
}
const bg = await sbx.commands.run("cat", { background: true, stdin: true });
await sbx.commands.sendStdin(bg.pid, "js-in\n");
await sbx.commands.closeStdin(bg.pid);
check((await bg.wait()).stdout === "js-in\n", "stdin");

await sbx.files.write(`${workdir}/js.txt`, "from js");
check((await sbx.files.read(`${workdir}/js.txt`)) === "from js", "read back");
const names = (await sbx.files.list(workdir)).map((e) => e.name);
check(names.includes("js.txt"), "list " + names);

const events = [];
const w = await sbx.files.watchDir(workdir, (ev) => events.push(ev));
await sbx.files.write(`${workdir}/watched.txt`, "x");
for (let i = 0; i < 100 && !events.some((e) => e.name === "watched.txt"); i++) await new Promise((res) => setTimeout(res, 50));
await w.stop();
check(events.some((e) => e.name === "watched.txt" && e.type === "create"), "watch " + JSON.stringify(events));

let notFound = false;
try { await sbx.files.getInfo(`${workdir}/nope`); } catch (e) { notFound = e.name === "FileNotFoundError" || /not.*found|does not exist/i.test(String(e)); }
check(notFound, "getInfo on a missing path");
console.log("JS-SMOKE-OK");
