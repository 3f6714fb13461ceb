// Run by test_proxy_https.py under the test resolver: headless Chromium opens a get_host() URL
// (https://<port>-<id>.<domain>/...) by name. The page's certificate is accepted by its public key
// (SPKI_HASH), as a browser that trusts the server's CA would. Prints one JSON line.
import { chromium } from 'playwright-core'

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium', headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage',
    `--ignore-certificate-errors-spki-list=${process.env.SPKI_HASH}`],
})
try {
  const page = await browser.newPage()
  const resp = await page.goto(process.env.URL, { waitUntil: 'load', timeout: 60000 })
  const body = await page.evaluate(() => document.body.innerText)
  console.log(JSON.stringify({ status: resp.status(), body, protocol: await page.evaluate(() => performance.getEntriesByType('navigation')[0].nextHopProtocol) }))
} finally {
  await browser.close()
}
