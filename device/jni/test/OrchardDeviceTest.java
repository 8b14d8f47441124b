import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import org.orchard.device.OrchardDevice;
import org.orchard.device.OrchardDevice.OrchardException;

/**
 * Drives liborchard_device through the JNI binding as an Android app would:
 *
 *   java -Djava.library.path=BUILD -cp CLASSES OrchardDeviceTest BUNDLE DAMAGED_BUNDLE TEXT
 *
 * A damaged bundle is refused with the library's status and message; the good one opens,
 * the app's device state reaches the policy through the callback, and one training step
 * runs through the bundle's ExecuTorch program. Prints one line per check; exits 1 on the
 * first that fails.
 */
public final class OrchardDeviceTest {
  private static void check(boolean ok, String what) {
    if (!ok) {
      System.out.println("FAIL " + what);
      System.exit(1);
    }
    System.out.println("ok " + what);
  }

  public static void main(String[] args) throws Exception {
    check(!OrchardDevice.version().isEmpty(), "version " + OrchardDevice.version());
    try (OrchardDevice bad = OrchardDevice.open(args[1])) {
      check(false, "a damaged bundle opens");
    } catch (OrchardException e) {
      check(e.statusName.equals("ORCHARD_ERR_INTEGRITY") && e.status == 5, "damaged bundle: " + e.getMessage());
    }
    try (OrchardDevice dev = OrchardDevice.open(args[0])) {
      OrchardDevice.DeviceState state = new OrchardDevice.DeviceState();
      state.batteryPercent = 80;
      state.charging = 1;
      state.temperatureC = 30;
      state.unmeteredNetwork = 1;
      state.idle = 1;
      dev.setStateSource(() -> state);
      check(dev.checkEligibility() == 0, "eligible when charging, cool, idle, on Wi-Fi");
      state.thermalStatus = OrchardDevice.THERMAL_SEVERE;
      state.temperatureC = Double.NaN;
      int hot = dev.checkEligibility();
      check((hot & 4) != 0, "the OS thermal status SEVERE makes it ineligible (" + dev.lastMessage() + ")");
      dev.setStateSource(() -> {
        throw new IllegalStateException("sensor gone");
      });
      try {
        dev.checkEligibility();
        check(false, "a failing state source is reported");
      } catch (OrchardException e) {
        check(e.statusName.equals("ORCHARD_ERR_DEVICE"), "a failing state source: " + e.getMessage());
      }
      try {
        dev.setOption("no_such_option", "1");
        check(false, "an unknown option is refused");
      } catch (OrchardException e) {
        check(e.status == 1, "unknown option: " + e.getMessage());
      }
      String text = new String(Files.readAllBytes(Paths.get(args[2])), StandardCharsets.UTF_8);
      dev.setText(text);
      OrchardDevice.RoundReport r = dev.trainLocal(1, 4, 0.5);
      check(r.numSteps == 1 && r.numExamples > 0 && r.trainLoss > 0 && !Double.isNaN(r.trainLoss),
            "one training step: steps=" + r.numSteps + " examples=" + r.numExamples + " loss=" + r.trainLoss);
    }
    System.out.println("PASSED");
  }
}
