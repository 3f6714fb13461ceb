// E2B SDK basics with one pinned npm `e2b`: E2B_SDK_MODULE names the package to import (`e2b` = the
// suite's pin, `e2b-latest` = the newest release, an npm alias in package.json; see docs/cli.md).
// Run by tests/e2e/test_e2e_sdk_versions.py as a program (the same steps as tests/e2e/sdk_basics.py):
// create, commands, files, list, pause/resume (files and a running process survive), kill.
// Needs E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY. Prints one JSON line: the SDK version and the
// steps that passed; exits non-zero on the first failure.
import { randomBytes } from 'node:crypto'
import { readFileSync } from 'node:fs'

const moduleName = process.env.E2B_SDK_MODULE || 'e2b'
const { Sandbox, CommandExitError } = await import(moduleName)
const { version } = JSON.parse(readFileSync(new URL(`./node_modules/${moduleName}/package.json`, import.meta.url), 'utf8'))

const steps = []
function check(step, ok, detail = '') {
  if (!ok) throw new Error(`${step}: ${typeof detail === 'string' ? detail : JSON.stringify(detail)}`)
  steps.push(step)
}

async function inList(sandboxId, run, state) {
  const pages = Sandbox.list({ query: { metadata: { run }, state: [state] } })
  const found = []
  while (pages.hasNext) found.push(...(await pages.nextItems()).map((s) => s.sandboxId))
  return found.length === 1 && found[0] === sandboxId
}

async function main() {
  const run = randomBytes(6).toString('hex')
  const sbx = await Sandbox.create({ metadata: { suite: 'sdk-versions', run }, envs: { RUN_TAG: run }, timeoutMs: 180_000 })
  try {
    const r = await sbx.commands.run('echo $RUN_TAG; echo err >&2')
    check('commands.run', r.exitCode === 0 && r.stdout === `${run}\n` && r.stderr === 'err\n', r)
    try {
      await sbx.commands.run('exit 7')
      check('commands.exit_code', false, 'no CommandExitError')
    } catch (e) {
      check('commands.exit_code', e instanceof CommandExitError && e.exitCode === 7, String(e))
    }
    const bg = await sbx.commands.run('sleep 600', { background: true })

    await sbx.files.write('/home/user/dir/data.txt', `data ${run}`)
    check('files.read', (await sbx.files.read('/home/user/dir/data.txt')) === `data ${run}`)
    const names = (await sbx.files.list('/home/user/dir')).map((e) => e.name)
    check('files.list', names.length === 1 && names[0] === 'data.txt', names)

    check('list.running', await inList(sbx.sandboxId, run, 'running'))
    await sbx.pause()
    check('pause', (await Sandbox.getInfo(sbx.sandboxId)).state === 'paused')
    check('list.paused', await inList(sbx.sandboxId, run, 'paused'))
    const resumed = await Sandbox.connect(sbx.sandboxId)
    check('resume.files', (await resumed.files.read('/home/user/dir/data.txt')) === `data ${run}`)
    const pids = (await resumed.commands.list()).map((p) => p.pid)
    check('resume.process', pids.includes(bg.pid), pids)

    check('kill', (await Sandbox.kill(sbx.sandboxId)) === true)
    check('killed', !(await inList(sbx.sandboxId, run, 'running')) && !(await inList(sbx.sandboxId, run, 'paused')))
  } finally {
    await Sandbox.kill(sbx.sandboxId).catch(() => {})
  }
  console.log(JSON.stringify({ sdk: 'js', version, steps }))
}

try {
  await main()
  process.exit(0)
} catch (e) {
  console.error(`failed after ${JSON.stringify(steps)}: ${e?.stack ?? e}`)
  process.exit(1)
}
